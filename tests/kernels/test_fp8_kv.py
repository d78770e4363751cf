"""The fp8 KV cache (float8_e4m3fn) in the three kernels that touch it: the RoPE + K/V write quantizes with the
layer's scales, decode and prefill attention dequantize in registers. Each Triton launcher is compared with
its reference over query dtypes (on CPU through TRITON_INTERPRET=1; on CUDA compiled, bf16 queries added) and
odd shapes, with scales other than 1 so that a scale applied twice, or not at all, fails.

Triton 3.8's interpreter loads all 256 e4m3 codes right (but 0x7f, NaN, read as 480: never stored, the writes
saturate), but its fp32 -> e4m3 conversion rounds wrongly where rounding carries into the exponent (7.845 -> 4,
not 8: 2.4% of randn * 4 values), so the RoPE write's fp8 path is compared on CUDA only; the attention kernels,
which only load fp8, run here too."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch

from pdserve.kernels.decode_attention import decode_attention_ref
from pdserve.kernels.fp8 import (
    FP8_E4M3_MAX,
    dequantize_kv_ref,
    fp8_k_stored,
    fp8_k_tokens,
    fp8_v_stored,
    fp8_v_tokens,
    quantize_kv_ref,
)
from pdserve.kernels.prefill_attention import PrefillShape, prefill_attention, prefill_attention_ref
from pdserve.kernels.rope import build_cos_sin_cache, rope_kv_write_ref

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.5, 2.0


def _fp8_cache(paged_kv: Callable, seq_lens: list[int], kv_heads: int, dim: int, block_size: int):
    cache, tables = paged_kv(seq_lens, kv_heads, dim, block_size, torch.float32)
    k = fp8_k_stored(quantize_kv_ref(cache[0] * 3, K_SCALE, FP8))  # values ~ +-10 after dequantizing: not a
    v = fp8_v_stored(quantize_kv_ref(cache[1] * 3, V_SCALE, FP8))  # trivial scale; the fp8 layouts (kernels/fp8.py)
    return torch.stack([k.view(torch.uint8), v.view(torch.uint8)]).view(FP8), tables


def test_quantize_saturates_and_round_trips() -> None:
    x = torch.tensor([0.0, 1.0, -3.0, 1e4, -1e4])
    q = quantize_kv_ref(x, 2.0, FP8)
    assert q.dtype == FP8
    assert dequantize_kv_ref(q, 2.0).tolist() == [0.0, 1.0, -3.0, 2 * FP8_E4M3_MAX, -2 * FP8_E4M3_MAX]
    assert quantize_kv_ref(x, 2.0, torch.float16).tolist() == x.half().tolist()  # other dtypes: a plain cast


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton interpreter rounds fp32 -> e4m3 wrongly")
@pytest.mark.parametrize("tokens,q_heads,kv_heads,dim,block_size", [(1, 1, 1, 64, 16), (17, 9, 3, 64, 16),
                                                                    (5, 4, 2, 96, 4)])
def test_rope_kv_write_fp8_matches_ref(
    tokens: int, q_heads: int, kv_heads: int, dim: int, block_size: int,
    dtype: torch.dtype, randn: Callable, check: Callable, device: str,
) -> None:
    from pdserve.kernels.rope_triton import rope_kv_write_triton

    cos_sin = build_cos_sin_cache(dim, 256, 10000.0).to(device)
    qkv = randn(tokens, q_heads + 2 * kv_heads, dim, dtype=dtype) * 4
    q, k, v = qkv.split([q_heads, kv_heads, kv_heads], dim=1)
    positions = torch.randint(0, 256, (tokens,), device=device)
    num_blocks = (tokens + block_size - 1) // block_size + 2
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[1::3] = -1
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, dim, dtype=FP8, device=device)
    q_ref, k_ref, cache_ref = q.clone(), k.clone(), cache.clone()
    rope_kv_write_ref(q_ref, k_ref, v, positions, cos_sin, cache_ref, slots, K_SCALE, V_SCALE)
    rope_kv_write_triton(q, k, v, positions, cos_sin, cache, slots, K_SCALE, V_SCALE)
    check(q, q_ref, dtype)
    check(k, k_ref, dtype)
    # quantized from the same rounded keys: the bytes match, but for a rotation rounded the other way (GPU FMA)
    same = (cache.view(torch.uint8) == cache_ref.view(torch.uint8)).float().mean().item()
    assert same >= 0.999, same
    written = cache_ref[0].float().abs().sum() + cache_ref[1].float().abs().sum()
    assert written > 0 and not torch.isnan(cache.float()).any()
    kept = slots >= 0
    values = fp8_v_tokens(cache_ref[1]).reshape(-1, kv_heads, dim)[slots[kept].long()]  # the fp8 layouts
    torch.testing.assert_close(dequantize_kv_ref(values, V_SCALE), v[kept].float(), rtol=0.07, atol=2e-2)
    keys = fp8_k_tokens(cache_ref[0]).reshape(-1, kv_heads, dim)[slots[kept].long()]
    torch.testing.assert_close(dequantize_kv_ref(keys, K_SCALE), k_ref[kept].float(), rtol=0.07, atol=2e-2)


def test_fp8_layouts_written_and_read_back(randn: Callable, device: str) -> None:
    """An fp8 cache's K is stored [Hkv, PAGE, D] a block and its V [Hkv, D, PAGE] (kernels/fp8.py): the reference
    writer puts a token's keys and values there, and the readers' gather gives back every token's."""
    from pdserve.kernels.paged import gather_sequence_kv
    from pdserve.kernels.rope import write_kv_ref

    tokens, kv_heads, dim, page = 21, 2, 8, 4
    k, v = randn(tokens, kv_heads, dim) * 4, randn(tokens, kv_heads, dim) * 4
    cache = torch.zeros(2, 8, page, kv_heads, dim, dtype=FP8, device=device)
    table = torch.tensor([5, 0, 7, 2, 3, 6], dtype=torch.int32, device=device)
    slots = table.long().repeat_interleave(page) * page + torch.arange(page, device=device).repeat(6)
    write_kv_ref(k, v, cache, slots[:tokens], K_SCALE, V_SCALE)
    stored = cache[1].view(torch.uint8)[5].view(kv_heads, dim, page)  # block 5 holds tokens 0-3
    assert torch.equal(stored[1, 3], quantize_kv_ref(v[:page, 1, 3], V_SCALE, FP8).view(torch.uint8))
    keys = cache[0].view(torch.uint8)[5].view(kv_heads, page, dim)
    assert torch.equal(keys[1], quantize_kv_ref(k[:page, 1], K_SCALE, FP8).view(torch.uint8))
    assert torch.equal(fp8_k_stored(fp8_k_tokens(cache[0])).view(torch.uint8), cache[0].view(torch.uint8))
    assert torch.equal(fp8_v_stored(fp8_v_tokens(cache[1])).view(torch.uint8), cache[1].view(torch.uint8))
    k_read, v_read = gather_sequence_kv(cache, table, tokens)
    assert torch.equal(v_read.view(torch.uint8), quantize_kv_ref(v, V_SCALE, FP8).view(torch.uint8))
    assert torch.equal(k_read.view(torch.uint8), quantize_kv_ref(k, K_SCALE, FP8).view(torch.uint8))


def test_cache_strides_address_an_fp8_caches_k_head_major(device: str) -> None:
    """The kernels' K strides: the tensor's own for other dtypes; (D, PAGE * D) for token and head of an fp8
    cache, whose blocks must be dense (a view with other strides is refused, not read wrong)."""
    from pdserve.kernels.fp8 import cache_strides

    plain = torch.zeros(2, 5, 16, 3, 64, device=device)
    assert cache_strides(plain) == plain.stride()[:4]
    fp8 = plain.to(FP8)
    assert cache_strides(fp8) == (5 * 16 * 3 * 64, 16 * 3 * 64, 64, 16 * 64)
    with pytest.raises(ValueError, match="dense"):
        cache_strides(torch.zeros(2, 5, 3, 16, 64, device=device).to(FP8).transpose(2, 3))


DECODE_CASES = [(3, 1, 64, 16, [100, 0, 16]), (9, 3, 64, 16, [33, 1]), (4, 4, 48, 8, [17, 9])]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{c[0]}q{c[1]}kv-d{c[2]}-bs{c[3]}")
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_attention_fp8_matches_ref(
    case: tuple, splits: int, dtype: torch.dtype, randn: Callable, paged_kv: Callable, check: Callable, device: str
) -> None:
    from pdserve.kernels.decode_attention_triton import _launch

    q_heads, kv_heads, dim, block_size, seq_lens = case
    cache, tables = _fp8_cache(paged_kv, seq_lens, kv_heads, dim, block_size)
    q = randn(len(seq_lens), q_heads, dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = _launch(q, cache, lens, tables, dim**-0.5, num_splits=splits, config=(16, 4, 2),
                  k_scale=K_SCALE, v_scale=V_SCALE)
    ref = decode_attention_ref(q, cache, lens, tables, dim**-0.5, K_SCALE, V_SCALE)
    check(out, ref, dtype, scale=8.0)  # outputs ~ +-10 (values x V_SCALE): the tolerance is relative to 1


def test_fp8_plan_splits_many_programs_into_two_warp_tiles() -> None:
    """An fp8 cache's default plan (kernels/decode_attention_triton.py fp8_plan) at llama3-8b's 8 kv heads on 132
    SMs: below one program a SM, num_splits_for's splits and the few-programs tile; from there, 64-key two-warp
    three-stage tiles split up to ~6 programs a SM, never below 256 keys a split."""
    from pdserve.kernels.decode_attention_triton import _FP8_TILE, fp8_plan, num_splits_for

    many = (64, 2, 3)
    assert fp8_plan(1, 8, 4096, 132) == (num_splits_for(1, 8, 4096, 132), _FP8_TILE) == (16, _FP8_TILE)
    assert fp8_plan(16, 8, 4096, 132) == (num_splits_for(16, 8, 4096, 132), _FP8_TILE)  # 128 programs
    assert fp8_plan(17, 8, 4096, 132) == (8, many)  # 136 programs: 6 * 132 / 136 -> 8
    assert fp8_plan(64, 8, 4096, 132) == (2, many)
    assert fp8_plan(64, 8, 256, 132) == (1, many)  # one split of 256 keys at most
    assert fp8_plan(128, 8, 4096, 132) == (1, many)


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_attention_fp8_two_warp_tile_matches_ref(
    splits: int, dtype: torch.dtype, randn: Callable, paged_kv: Callable, check: Callable, device: str
) -> None:
    """The plan's many-programs tile (64 keys, 2 warps, 3 stages: four pages of 16 a tile), split or not, over
    sequences that end inside a tile, a page and a split."""
    from pdserve.kernels.decode_attention_triton import _launch

    seq_lens = [200, 1, 64, 97]
    cache, tables = _fp8_cache(paged_kv, seq_lens, 2, 64, 16)
    q = randn(len(seq_lens), 8, 64, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = _launch(q, cache, lens, tables, 64**-0.5, num_splits=splits, config=(64, 2, 3),
                  k_scale=K_SCALE, v_scale=V_SCALE)
    check(out, decode_attention_ref(q, cache, lens, tables, 64**-0.5, K_SCALE, V_SCALE), dtype, scale=8.0)


FP8_VARIANTS = ["kt", "pages", "kt+pages", "bits", "kt+bits", "bits+pages", "fma", "fma+kt", "fma+pages",
                "fma+kt+pages", "fma+bits", "vwide", "kt+vwide", "kt+pages+vwide"]  # VARIANTS but "dot"
# the interpreter runs each flag alone (33 s for all 11 there: suite time); the GPU every combination
CHECKED_VARIANTS = FP8_VARIANTS if torch.cuda.is_available() else ["dot", "kt", "pages", "bits", "fma", "vwide"]


@pytest.mark.parametrize("variant", CHECKED_VARIANTS)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{c[0]}q{c[1]}kv-d{c[2]}-bs{c[3]}")
def test_decode_attention_fp8_variants_match_ref(
    case: tuple, variant: str, dtype: torch.dtype, randn: Callable, paged_kv: Callable, check: Callable, device: str
) -> None:
    """The fp8 path's candidate variants (what benchmarks/decode_attention_fp8_gpu.py sweeps), split in 3, with a
    tile of two pages at block size 8 so that "pages" loads more than one table entry per tile."""
    from pdserve.kernels.decode_attention_triton import VARIANTS, _launch

    assert ["dot", *FP8_VARIANTS] == list(VARIANTS) and set(CHECKED_VARIANTS) <= set(VARIANTS)
    q_heads, kv_heads, dim, block_size, seq_lens = case
    cache, tables = _fp8_cache(paged_kv, seq_lens, kv_heads, dim, block_size)
    q = randn(len(seq_lens), q_heads, dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = _launch(q, cache, lens, tables, dim**-0.5, num_splits=3, config=(16, 4, 2),
                  k_scale=K_SCALE, v_scale=V_SCALE, variant=variant)
    ref = decode_attention_ref(q, cache, lens, tables, dim**-0.5, K_SCALE, V_SCALE)
    check(out, ref, dtype, scale=8.0)


def test_decode_attention_fp8_ref_is_the_dequantized_cache(randn: Callable, paged_kv: Callable, device: str) -> None:
    """The reference over fp8 equals the reference over the dequantized cache in the query's dtype (fp32)."""
    cache, tables = _fp8_cache(paged_kv, [40, 7], 2, 64, 16)
    q = randn(2, 4, 64)
    lens = torch.tensor([40, 7], dtype=torch.int32, device=device)
    plain = torch.stack([dequantize_kv_ref(fp8_k_tokens(cache[0]), K_SCALE),
                         dequantize_kv_ref(fp8_v_tokens(cache[1]), V_SCALE)])
    torch.testing.assert_close(decode_attention_ref(q, cache, lens, tables, 0.125, K_SCALE, V_SCALE),
                               decode_attention_ref(q, plain, lens, tables, 0.125))


PREFILL_CASES = [(3, 1, 64, 16, [(100, 0), (5, 32), (17, 33)]), (2, 2, 48, 8, [(19, 5)])]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"{c[0]}q{c[1]}kv-d{c[2]}-bs{c[3]}")
def test_prefill_attention_fp8_matches_ref(
    case: tuple, dtype: torch.dtype, randn: Callable, paged_kv: Callable, check: Callable, device: str
) -> None:
    from pdserve.kernels.prefill_attention_triton import _launch

    q_heads, kv_heads, dim, block_size, chunks = case
    seq_lens = [q_len + prefix for q_len, prefix in chunks]
    cache, tables = _fp8_cache(paged_kv, seq_lens, kv_heads, dim, block_size)
    cu = torch.tensor([0] + [q_len for q_len, _ in chunks], device=device).cumsum(0).to(torch.int32)
    q = randn(int(cu[-1]), q_heads, dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = _launch(q, cache, cu, lens, tables, dim**-0.5, config=(16, 16, 4, 2), k_scale=K_SCALE, v_scale=V_SCALE)
    ref = prefill_attention_ref(q, cache, cu, lens, tables, dim**-0.5, K_SCALE, V_SCALE)
    check(out, ref, dtype, scale=8.0)


@pytest.mark.parametrize("bucket", [0, 16, 24, 64])  # 24: fewer rows than whole blocks
def test_prefill_attention_sdpa_fp8_reads_the_codes(bucket: int, randn: Callable, paged_kv: Callable,
                                                     device: str) -> None:
    """Whole prompts over an fp8 cache through SDPA (the math backend, which runs anywhere): each prompt's codes
    gathered from its shuffled blocks, K's scale in the softmax scale, V's on the output, padded or not to
    `bucket` rows: the reference's answer over the same cache."""
    from pdserve.kernels.prefill_attention import prefill_attention_sdpa_fp8

    lens = [20, 37]
    cache, tables = _fp8_cache(paged_kv, lens, 2, 64, 16)
    q = randn(sum(lens), 4, 64)
    cu = torch.tensor([0, 20, 57], dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = prefill_attention_sdpa_fp8(q, cache, tables, tuple(lens), 0.125, K_SCALE, V_SCALE, "math", bucket)
    ref = prefill_attention_ref(q, cache, cu, seq_lens, tables, 0.125, K_SCALE, V_SCALE)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's attention: a GPU")
@pytest.mark.parametrize("bucket", [0, 256])
def test_prefill_attention_sdpa_fp8_on_cudnn(bucket: int, randn: Callable, paged_kv: Callable) -> None:
    """The served backend: bf16 queries through cuDNN over the codes, both scales folded (K's into q, V's on
    the output), against the reference over the same cache, within bf16's rounding."""
    from pdserve.kernels.prefill_attention import prefill_attention_sdpa_fp8

    lens = [300, 77]
    cache, tables = _fp8_cache(paged_kv, lens, 8, 128, 16)
    q = randn(sum(lens), 32, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 300, 377], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = prefill_attention_sdpa_fp8(q, cache, tables, tuple(lens), 128**-0.5, K_SCALE, V_SCALE, "cudnn", bucket)
    ref = prefill_attention_ref(q, cache, cu, seq_lens, tables, 128**-0.5, K_SCALE, V_SCALE)
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


def test_prefill_attention_fp8_takes_sdpa_on_the_codes(randn: Callable, paged_kv: Callable, device: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatcher with an SDPA entry: a whole uncached prompt over an fp8 cache goes to SDPA, which reads
    the cache's codes, not k and v (wrong here on purpose: whoever reads them gets another answer)."""
    from pdserve.kernels import dispatch

    module = importlib.import_module("pdserve.kernels.prefill_attention")  # the package exports the function
    monkeypatch.setattr(module, "sdpa_entry", lambda *args: {"backend": "math", "min_tokens": 1, "bucket": 16})
    calls = []
    real = module.prefill_attention_sdpa_fp8
    monkeypatch.setattr(module, "prefill_attention_sdpa_fp8", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    cache, tables = _fp8_cache(paged_kv, [20], 2, 64, 16)
    cu = torch.tensor([0, 20], dtype=torch.int32, device=device)
    lens = torch.tensor([20], dtype=torch.int32, device=device)
    q = randn(20, 4, 64)
    k = torch.zeros(20, 2, 64, device=device)
    monkeypatch.setattr(dispatch, "_backend", "triton")  # the GPU's dispatch, on this device
    out = prefill_attention(q, cache, cu, lens, tables, 0.125, k, k, PrefillShape((20,), False), K_SCALE, V_SCALE)
    ref = prefill_attention_ref(q, cache, cu, lens, tables, 0.125, K_SCALE, V_SCALE)
    assert len(calls) == 1
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_rope_kv_write_ref_fp8_stores_scaled_rotated_keys(randn: Callable, device: str) -> None:
    """The reference the CUDA test compares with: the cache holds rope(k) / K_SCALE and v / V_SCALE in fp8."""
    cos_sin = build_cos_sin_cache(64, 64, 10000.0).to(device)
    q, k, v = randn(6, 2, 64), randn(6, 1, 64) * 4, randn(6, 1, 64) * 4
    cache = torch.zeros(2, 2, 4, 1, 64, dtype=FP8, device=device)
    slots = torch.tensor([0, 1, 2, 5, -1, 7], device=device)
    rope_kv_write_ref(q, k, v, torch.arange(6, device=device), cos_sin, cache, slots, K_SCALE, V_SCALE)
    keys = fp8_k_tokens(cache[0]).reshape(8, 1, 64)  # the fp8 layouts (kernels/fp8.py)
    values = fp8_v_tokens(cache[1]).reshape(8, 1, 64)
    rows = slots[slots >= 0]
    torch.testing.assert_close(keys[rows].float(), (k[slots >= 0] / K_SCALE).to(FP8).float())
    torch.testing.assert_close(values[rows].float() * V_SCALE, v[slots >= 0], rtol=0.07, atol=2e-2)
    assert not keys[[3, 4, 6]].float().any() and not values[[3, 4, 6]].float().any()  # unwritten slots


def test_block_copies_move_fp8_bytes_as_they_are(device: str) -> None:
    """gather / scatter / copy of a 1-byte cache: the launchers' bytes equal the references' and the source's
    (no conversion: fp8 -> fp8 is a plain move, so even the interpreter's rounding never enters)."""
    from pdserve.kernels.block_copy import copy_blocks_ref, gather_blocks_ref
    from pdserve.kernels.block_copy_triton import (
        copy_blocks_triton,
        gather_blocks_triton,
        scatter_blocks_triton,
    )

    codes = torch.randint(0, 256, (2, 6, 16, 3, 48), dtype=torch.uint8, device=device)
    codes[codes == 0x7F] = 0  # NaN codes aside
    codes[codes == 0xFF] = 0
    cache = codes.view(FP8)
    ids = torch.tensor([4, 0, 3], dtype=torch.int32, device=device)
    packed = gather_blocks_triton(cache, ids)
    assert torch.equal(packed.view(torch.uint8), gather_blocks_ref(cache, ids).view(torch.uint8))
    assert torch.equal(packed.view(torch.uint8), codes[:, ids.long()])
    dst = torch.zeros_like(cache)
    scatter_blocks_triton(dst, ids, packed)
    assert torch.equal(dst[:, ids.long()].view(torch.uint8), codes[:, ids.long()])
    out, out_ref = torch.zeros_like(cache), torch.zeros_like(cache)
    dst_ids = torch.tensor([1, 2, 5], dtype=torch.int32, device=device)
    copy_blocks_triton(cache, ids, out, dst_ids)
    copy_blocks_ref(cache, ids, out_ref, dst_ids)
    assert torch.equal(out.view(torch.uint8), out_ref.view(torch.uint8))
