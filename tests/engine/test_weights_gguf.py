"""GGUF files written here with gguf.GGUFWriter, the way llama.cpp's converter writes them, read back.

Covers what the embedded SmolLM2 file does not: untied heads, Qwen2 q/k/v biases (not permuted), Llama 3.1
rope scaling stored as a rope_freqs tensor, and files without a tokenizer; and the one-time conversion's progress
(a bar on stderr, a log line with its time), shown on a tiny file as on SmolLM2's (~15 CPU-s to convert).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from pdserve.engine.config import Llama3RopeScaling
from pdserve.engine.presets import weight_shapes
from pdserve.engine.weights import ModelSpec, load_model
from pdserve.engine.weights.convert import CONVERSION_INFO, ensure_converted
from pdserve.engine.weights.gguf_file import read_gguf
from pdserve.engine.weights.hf_config import hf_config
from pdserve.kernels.rope import rope_inv_freq

_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_SCALING = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192)


@dataclass(frozen=True)
class TinyGGUF:
    arch: str
    tied: bool = True
    rope_scaling: bool = False
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    layers: int = 2


def _gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: rotate-half rows → interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _reference_weights(spec: TinyGGUF) -> dict[str, np.ndarray]:
    from pdserve.engine.config import ModelConfig

    config = ModelConfig(name="t", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=spec.layers,
                         num_heads=spec.heads, num_kv_heads=spec.kv_heads, head_dim=spec.head_dim,
                         max_model_len=256, attention_bias=spec.arch == "qwen2")
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in weight_shapes(config).items()}
    if spec.tied:
        del weights["lm_head.weight"]
    # token_embd is Q8_0 in real files: the reference is what survives quantisation
    embed = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = dequantize(quantize(embed, GGMLQuantizationType.Q8_0),
                                                      GGMLQuantizationType.Q8_0)
    return weights


def write_tiny_gguf(path: Path, spec: TinyGGUF, extra: dict[str, object] | None = None) -> dict[str, np.ndarray]:
    """Write a tiny GGUF (with `extra` key/values); returns the weights in HF layout that a correct reader must
    give back."""
    weights = _reference_weights(spec)
    writer = GGUFWriter(str(path), spec.arch)
    for key, value in (extra or {}).items():
        _add_value(writer, key, value)
    writer.add_block_count(spec.layers)
    writer.add_context_length(256)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(48)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_bos_token_id(5)
    writer.add_eos_token_id(7)
    if spec.rope_scaling:
        base = rope_inv_freq(spec.head_dim, 500000.0, None)
        writer.add_tensor("rope_freqs.weight", (base / rope_inv_freq(spec.head_dim, 500000.0, _SCALING)).numpy())
    for name, w in weights.items():
        stored = w
        if spec.arch == "llama" and ".q_proj.weight" in name:
            stored = _llama_cpp_permute(w, spec.heads)
        elif spec.arch == "llama" and ".k_proj.weight" in name:
            stored = _llama_cpp_permute(w, spec.kv_heads)
        if name == "model.embed_tokens.weight":
            writer.add_tensor(_gguf_name(name), quantize(stored, GGMLQuantizationType.Q8_0),
                              raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(_gguf_name(name), stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def _add_value(writer: GGUFWriter, key: str, value: object) -> None:
    if isinstance(value, list):
        writer.add_array(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    else:
        raise TypeError(f"{key}: {value!r}")


@pytest.mark.parametrize(
    "spec",
    [TinyGGUF("llama"), TinyGGUF("llama", tied=False, rope_scaling=True), TinyGGUF("qwen2", tied=False)],
    ids=["llama-tied", "llama3-rope-untied", "qwen2-bias"],
)
def test_gguf_weights_come_back_in_hf_layout(tmp_path: Path, spec: TinyGGUF) -> None:
    path = tmp_path / f"tiny-{spec.arch}.gguf"
    reference = write_tiny_gguf(path, spec)
    loaded = load_model(ModelSpec(str(path)), dtype=torch.float32, cache_dir=tmp_path / "cache")
    for name, w in reference.items():
        assert torch.equal(loaded.weights[name], torch.from_numpy(w)), name
    head = loaded.weights["lm_head.weight"]
    assert (head is loaded.weights["model.embed_tokens.weight"]) == spec.tied
    config = loaded.config
    assert config.attention_bias == (spec.arch == "qwen2")
    assert config.rope_scaling == (_SCALING if spec.rope_scaling else None)
    assert (config.max_model_len, config.bos_token_id, config.eos_token_ids) == (256, 5, (7,))
    assert loaded.tokenizer is None  # no tokenizer metadata in these files
    # the cached conversion is an HF directory whose config reads back the same
    assert loaded.path is not None and hf_config(loaded.path, config.name) == config


def test_conversion_is_cached(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinyGGUF("llama"))
    first = load_model(str(path), cache_dir=tmp_path / "cache")
    assert first.path is not None
    mtime = (first.path / "model.safetensors").stat().st_mtime_ns
    second = load_model(str(path), cache_dir=tmp_path / "cache")
    assert second.path == first.path and (first.path / "model.safetensors").stat().st_mtime_ns == mtime
    assert second.fingerprint == first.fingerprint
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()] == [first.path.name]


def test_conversion_shows_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinyGGUF("llama"))
    caplog.set_level(logging.INFO, logger="pdserve.engine.weights.convert")
    out = ensure_converted(path, tmp_path / "converted", "tiny-test")
    err = capsys.readouterr().err
    assert f"converting {path.name} (once)" in err and "100%" in err, err
    seconds = json.loads((out / CONVERSION_INFO).read_text())["convert_seconds"]
    assert any(r.getMessage() == f"converted {path.name} into {out} in {seconds:.1f} s"
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_read_gguf_gives_what_gguf_reader_gives(tmp_path: Path) -> None:
    """Every key/value (strings, scalars, string and number arrays, as the tokenizer's are) and every tensor's
    info and bytes, against gguf-py's own reader, on a file with an untied head, rope_freqs and Q8_0 data."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinyGGUF("llama", tied=False, rope_scaling=True),
                    extra={"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["<s>", "a", "ĠbÃ", "é"],
                           "tokenizer.ggml.token_type": [3, 1, 1, 1], "tokenizer.ggml.scores": [0.0, -1.5, 2.0, 0.25],
                           "tokenizer.ggml.add_bos_token": True, "general.name": "tiny ✓"})
    ours, theirs = read_gguf(path), GGUFReader(path)
    assert ours.fields == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields["tokenizer.ggml.tokens"] == ["<s>", "a", "ĠbÃ", "é"]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        data = ours.tensor_data(mine)
        assert (mine.ggml_type, mine.dims, mine.nbytes) == (reference.tensor_type, tuple(reference.shape.tolist()),
                                                            reference.n_bytes), mine.name
        assert ours.layout.data_offset + mine.offset == reference.data_offset, mine.name
        assert data.dtype == reference.data.dtype and np.array_equal(data, reference.data), mine.name
