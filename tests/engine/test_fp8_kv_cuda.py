"""An fp8 KV cache on the GPU (skipped elsewhere): a bf16 model over a float8_e4m3fn pool, Triton kernels and
decode CUDA graphs, against the same model and pool on the plain-torch references; and decode attention at
Llama-3-8B's head shape over a 4,096-token fp8 context against its reference; scales calculated on the GPU
(--calculate-kv-scales) with either backend."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.engine.attention_metadata import DecodeInput, PrefillChunk
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.kv_cache_spec import KVCacheSpec
from pdserve.engine.kv_scale_calibration import calibrate_kv_scales, calibration_tokens
from pdserve.engine.model import fuse_weights
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights.dummy import dummy_weights
from pdserve.kernels.decode_attention import decode_attention_ref
from pdserve.kernels.decode_attention_triton import decode_attention_triton
from pdserve.kernels.fp8 import quantize_kv_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8 Triton kernels need a GPU")
MODEL = ModelConfig(name="tiny-fp8", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                    num_heads=8, num_kv_heads=2, head_dim=128, max_model_len=1024)
FP8 = torch.float8_e4m3fn


def _run(backend: str, spec: KVCacheSpec) -> torch.Tensor:
    kernels.set_backend(backend)
    try:
        runner = ModelRunner(MODEL, CacheConfig(num_blocks=64, block_size=16), dummy_weights(MODEL, torch.bfloat16,
                             "cuda", seed=3), "cuda", torch.bfloat16, max_num_seqs=4,
                             enforce_eager=backend == "ref", kv_spec=spec)
        prompts = [list(range(5, 205)), list(range(300, 333))]
        tables = [list(range(16)), list(range(16, 32))]
        out = runner.prefill([PrefillChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
        rows, tokens = [out.logits], out.logits.argmax(-1).tolist()
        for step in range(4):
            items = [DecodeInput(tok, len(p) + step, t) for tok, p, t in zip(tokens, prompts, tables, strict=True)]
            logits = runner.decode(items)
            rows.append(logits.clone())
            tokens = logits.argmax(-1).tolist()
        assert runner.kv_caches[0].dtype == FP8
        return torch.cat(rows)
    finally:
        kernels.set_backend("auto")


def test_fp8_pool_with_triton_and_graphs_matches_the_references() -> None:
    spec = KVCacheSpec.build("fp8", torch.bfloat16, MODEL.num_layers, ([0.5, 2.0], [0.25, 1.0]))
    ours, ref = _run("auto", spec), _run("ref", spec)
    assert torch.isfinite(ours).all()
    diff = (ours - ref).abs().max().item()
    assert diff < 0.05 * ref.abs().max().item(), diff  # bf16 activations, rounded differently along the way


@pytest.mark.parametrize("backend", ["auto", "ref"])
def test_calculated_scales_on_the_gpu_put_the_texts_codes_in_112_to_224(backend: str) -> None:
    """--calculate-kv-scales on the GPU: a bf16 scratch prefill (Triton / SDPA, or the references) gives powers of
    two, and an fp8 pool with them holds the calibration tokens' largest K and V code of each layer in [112, 224]
    (the RoPE + K/V write kernel applying each layer's scales)."""
    kernels.set_backend(backend)
    try:
        weights = fuse_weights(MODEL, dummy_weights(MODEL, torch.bfloat16, "cuda", seed=3), torch.device("cuda"),
                               torch.bfloat16, "none")
        tokens = calibration_tokens(None, MODEL)
        k, v = calibrate_kv_scales(MODEL, weights, tokens)
        spec = KVCacheSpec.build("fp8", torch.bfloat16, MODEL.num_layers, (k, v))
        runner = ModelRunner(MODEL, CacheConfig(num_blocks=64, block_size=16), weights, "cuda", torch.bfloat16,
                             max_num_seqs=4, enforce_eager=True, kv_spec=spec)
        runner.prefill([PrefillChunk(tokens, 0, list(range(-(-len(tokens) // 16))))])
        for kv in runner.kv_caches:
            for half in (0, 1):
                assert 112 <= kv[half].float().abs().max().item() <= 224, (k, v)
    finally:
        kernels.set_backend("auto")


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_attention_fp8_llama3_8b_heads_ctx_4096(batch: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = batch * 256
    cache = torch.randn(2, blocks, 16, 8, 128, device="cuda", generator=gen)
    cache = torch.stack([quantize_kv_ref(cache[0] * 4, 0.5, FP8), quantize_kv_ref(cache[1] * 4, 0.25, FP8)])
    tables = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32).view(batch, 256)
    lens = torch.randint(1, 4097, (batch,), device="cuda", generator=gen).to(torch.int32)
    lens[0] = 4096
    q = torch.randn(batch, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    out = decode_attention_triton(q, cache, lens, tables, 128**-0.5, 0.5, 0.25)
    ref = decode_attention_ref(q, cache, lens, tables, 128**-0.5, 0.5, 0.25)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)
