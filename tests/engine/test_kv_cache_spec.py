"""The fp8 KV cache in the engine: the spec's rules (auto = the weights' dtype; fp8 = float8_e4m3fn with the
checkpoint's per-layer scales, else 1.0), its compatibility key, the scales read from a checkpoint directory,
the pool's size (1 byte a value: twice the sequences per GB of bf16), and a tiny model's forward over an fp8
pool against the same model over an fp32 pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_hf_models import make_tiny

from pdserve.engine.attention_metadata import DecodeInput, PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.kv_cache import blocks_for_bytes, kv_cache_bytes
from pdserve.engine.kv_cache_spec import KVCacheSpec
from pdserve.engine.presets import get_preset
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights import load_model
from pdserve.engine.weights.kv_scales import checkpoint_kv_scales, load_kv_cache_spec

FP8 = torch.float8_e4m3fn


def test_auto_is_the_weights_dtype_and_keeps_the_model_fingerprint() -> None:
    spec = KVCacheSpec.build("auto", torch.bfloat16, 4)
    assert spec.dtype == torch.bfloat16 and not spec.is_fp8 and spec.layer_scales(3) == (1.0, 1.0)
    assert spec.fingerprint("model-fp") == "model-fp"  # bf16 caches keep their block hashes and tier keys


def test_fp8_defaults_to_scale_one_and_keys_on_dtype_and_scales() -> None:
    spec = KVCacheSpec.build("fp8", torch.bfloat16, 2)
    assert spec.dtype == FP8 and spec.k_scales == (1.0, 1.0) and spec.v_scales == (1.0, 1.0)
    key = spec.fingerprint("model-fp")
    assert key != "model-fp" and key == KVCacheSpec.build("fp8", torch.float32, 2).fingerprint("model-fp")
    other = KVCacheSpec.build("fp8", torch.bfloat16, 2, ([1.0, 0.5], [1.0, 1.0]))
    assert other.layer_scales(1) == (0.5, 1.0) and other.fingerprint("model-fp") != key
    assert spec.fingerprint("another-model") != key
    # scales are float32 scalars: values that round to the same float32 are the same key
    assert KVCacheSpec.build("fp8", torch.bfloat16, 1, ([0.1], [1.0])).k_scales == (float(torch.tensor(0.1)),)


@pytest.mark.parametrize(("args", "message"), [
    (("fp16", torch.float32, 2, None), "unknown KV cache dtype 'fp16'"),
    (("fp8", torch.float32, 2, ([1.0], [1.0])), "1 K and 1 V scales for 2 layers"),
    (("fp8", torch.float32, 1, ([0.0], [1.0])), "positive and finite"),
])
def test_bad_specs_say_why(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVCacheSpec.build(*args)


def test_fp8_pool_holds_twice_the_sequences_per_gb_of_bf16() -> None:
    model = get_preset("llama3-8b")
    budget = 10 << 30
    bf16, fp8 = (blocks_for_bytes(model, 16, dtype, budget) for dtype in (torch.bfloat16, FP8))
    assert fp8 == 2 * bf16 and bf16 == 10 * 1024 // 2  # llama3-8b: 128 KiB of bf16 KV a token, 2 MiB a block
    cache = CacheConfig(num_blocks=100)
    assert kv_cache_bytes(model, cache, FP8) * 2 == kv_cache_bytes(model, cache, torch.bfloat16)


def _with_scales(path: Path, layers: int, k: list[float], v: list[float]) -> None:
    tensors = {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(s[i], dtype=torch.float32)
               for i in range(layers) for kind, s in (("k", k), ("v", v))}
    save_file(tensors, str(path / "kv_scales.safetensors"))


def test_checkpoint_scales_are_read_and_a_partial_set_refused(tmp_path: Path) -> None:
    tiny = make_tiny("llama", tmp_path / "m")
    assert checkpoint_kv_scales(tmp_path / "m", 3) is None
    _with_scales(tmp_path / "m", 3, [0.5, 1.0, 2.0], [0.25, 1.0, 4.0])
    loaded = load_model(str(tmp_path / "m"), dtype=torch.float32)
    spec = load_kv_cache_spec("fp8", torch.float32, loaded)
    assert spec.k_scales == (0.5, 1.0, 2.0) and spec.v_scales == (0.25, 1.0, 4.0)
    assert load_kv_cache_spec("auto", torch.float32, loaded).dtype == torch.float32  # auto ignores them
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(1.0)}, str(tmp_path / "m" / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match="KV scales for 1 of 6 layer halves"):
        checkpoint_kv_scales(tmp_path / "m", tiny.config.num_layers)


@pytest.mark.parametrize("scales", [None, ([0.05, 0.1, 0.2], [0.1, 0.05, 0.2])], ids=["scale-1", "checkpoint"])
def test_fp8_forward_tracks_the_fp32_pool(tmp_path: Path, scales: tuple | None) -> None:
    """Prefill (two chunks) then decode over an fp8 pool: logits within fp8's error of the fp32 pool's, the pool
    holds fp8, and the scales are used (small ones would saturate every value if applied the wrong way)."""
    tiny = make_tiny("llama", tmp_path)
    spec = KVCacheSpec.build("fp8", torch.float32, 3, scales)
    runners = [ModelRunner(tiny.config, CacheConfig(num_blocks=32, block_size=4), tiny.weights, "cpu", torch.float32,
                           max_num_seqs=4, kv_spec=kv) for kv in (None, spec)]
    ids = torch.randint(3, 96, (19,), generator=torch.Generator().manual_seed(0)).tolist()
    table = list(range(8))
    logits = []
    for runner in runners:
        runner.prefill([PrefillChunk(ids[:8], 0, table, need_logits=False)])
        first = runner.prefill([PrefillChunk(ids[8:], 8, table)]).logits[0]
        step = runner.decode([DecodeInput(int(first.argmax()), 19, table)])[0]
        logits.append(torch.stack([first, step]))
    assert runners[1].kv_caches[0].dtype == FP8
    assert (runners[1].kv_caches[0].float().abs() < 448).all()  # nothing saturated
    diff = (logits[1] - logits[0]).abs().max().item()
    assert 0 < diff < 0.05 * logits[0].abs().max().item(), diff
