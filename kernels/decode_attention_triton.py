"""Triton paged decode attention: FlashDecoding (split-KV) with the GQA group processed as one tile.

    grid (B, Hkv, S) split kernel                                  then (decode_attention_sum_triton.py)
    seq b, kv head h, split s: keys [s*L, min((s+1)*L, seq_len))   out[b, q] = sum_s w_s * o_s / sum_s w_s
      q tile [GROUP, D]  x  K tile^T [D, BLOCK_N]  (one load of K/V   w_s = 2^(lse_s - max lse)
      per kv head, shared by the GROUP query heads)
      -> o_s [GROUP, D] (normalised), lse_s [GROUP] (log2 domain)

L = ceil(ceil(seq_len / S) / BLOCK_N) * BLOCK_N is chosen per sequence on the device, so the launch needs no
host sync (CUDA-graph safe); S itself comes from the batch size and the block table's width. With S = 1 the
split kernel writes the output directly. Above, the S partials are summed in the split kernel by each (b, h)'s
last program where B * Hkv programs fill the SMs, else by a second kernel, grid (B, Hq)
(kernels/decode_attention_sum_triton.py: how, and why not everywhere). Splits past seq_len are empty
(lse = -inf); seq_len 0 gives zeros.

An fp8 cache (float8_e4m3fn) is loaded as fp8 and converted to the query's dtype in registers (exact: e4m3
fits in bf16 and fp16); its K scale is folded into qk_scale and its V scale multiplies the (linear) output of
each split, so the dots and the fp32 accumulation are those of a bf16 cache.

The fp8 path's variants (VARIANTS, picked by name; _FP8_VARIANT is an fp8 cache's default): "dot" as above;
"fma" computes q.K and p.V as fp32 broadcast-multiply-reduce over [GROUP, BLOCK_N, D] (the group unpadded, no
dot-operand layout, no fp16 round trip; short tiles); "kt" loads K as [D, BLOCK_N], the dot's right operand as it
is; "pages" loads one block-table entry per page of a tile instead of one per token; "bits" widens e4m3 to
fp16 by integer bit moves (exact, value / 256, the 256 folded into both scales) instead of the cvt instruction;
"vwide" lays V out for its dot from fp16, not fp8 (below). Every variant reads an fp8 cache's V in its layout,
[Hkv, D, PAGE] a block (kernels/fp8.py; V_T), a page's tokens one 16-byte load: on an H100, kt at 128x4x1 took
198.2 us a layer at B 64 ctx 4,096 against 220.6 with V token-major (docs/quantization.md). An fp8 cache's
default tile and split count come from fp8_plan (a two-warp tile pipelined three stages deep at every batch, split
by num_splits_for below one program a SM and to ~6 a SM above: on the H200 132 us at B 64 ctx 4,096 against
bf16's 246).
benchmarks/fp8_attention_sweep_h200.sh times every variant x tile; on the H200 (2026-12-02, CUDA-graph means,
benchmarks/results/decode_attention_fp8_h200.json), best tile each, against bf16's 243.5 / 38.3 / 13.9 us:
    B 64 ctx 4,096:  kt 219.5 us (1.11x bf16)  dot 226.6 (1.07x)  bits 313.0  pages 468.4  fma+kt 665.6
    B 64 ctx 512:    kt  34.7 us (1.10x)       dot  34.8          bits  47.2  pages  68.3  fma+kt  91.2
    B 1  ctx 4,096:  kt  12.9 us (1.07x)       dot  13.0          bits  16.4  pages  25.4  fma+kt  35.3
so "kt" with 128x4x2 was the default. Half the bytes bought ~10 %; an fp8 QK^T dot (q quantized, as
FlashAttention-3 does) was tried later and bought nothing (docs/quantization.md).

Why (found in the sm_90 PTX, `python benchmarks/kernels_aot.py` compiles it on a CPU): p.V's right operand V is
[BLOCK_N, D] with D contiguous, and the mma wants each thread's elements consecutive along BLOCK_N. For 16-bit
V, ldmatrix.trans does that transpose; Triton moves the e4m3 -> fp16 widening after the shared-memory load (the
dot operand is then fp8, kWidth 4), and for 8-bit elements it has no transposing load: "kt" at 128x4x2 compiles
to 128 ld.shared.b8 a thread a tile (one per V element) plus the byte packing, 195 registers. "vwide" widens V
in registers as loaded ([BLOCK_N, D] blocked, 16-byte vectors) and puts a select after the widening, which
Triton does not move the conversion past, so the fp16 tile goes to shared memory and comes back with
ldmatrix.trans as a bf16 cache's does: no ld.shared.b8, 96 registers at 64x4x3 (so 4 programs an SM, and b64's
512 programs are resident at once), at the price of an fp16 copy of the tile in shared memory. Measured on an
H100 (2026-12-06, OUT=dir bash benchmarks/fp8_attention_vwide_h200.sh; results/decode_attention_fp8_vwide_h100.json,
ncu_decode_attention_h100.txt), it is not faster: b64 ctx 4,096 kt 128x4x2 226.7 us (best kt 64x2x2 220.3),
kt+vwide 64x4x3 232.6, bf16 349.3; b64 ctx 512 40.5 / 35.9 / 36.2, bf16 50.5. Nsight Compute says why: kt's
limit is issue and latency (0.46 instructions issued a scheduler a cycle, 12.5 % occupancy at 209 registers,
DRAM 61 %), and vwide moves the cost into the shared-memory pipe (L1/TEX throughput 82 %: the fp16 tile written
and read back is 4 bytes an element against fp8's 1), DRAM 55 %; bf16's loop runs at 91 % of DRAM. So "kt"
stays the default; the transpose of 8-bit V is what an fp8 cache costs here (a byte-permute transpose in
registers, which Triton does not emit, is what is left).

What is compiled: the model's GROUP, HEAD_DIM, PAGE, the dtype's PRECISION and tile, and the split count S
through SINGLE (S == 1), COMBINE (S > 1 from one program a SM on) and the partials' strides (S * D: 16-divisible
or not). S = num_splits_for(batch, Hkv, table width) (fp8_plan's for an fp8 cache) is a power of two in 1..64, so
a few split kernels per model and tile, whatever the batch, and a reduce kernel per BLOCK_S = S below one program
a SM; the integer S itself is do_not_specialize.
The decode graphs' warm-up (engine/cuda_graphs.py) runs every bucket, hence every S and tile a served step can
reach (both come from the bucket and the table's width); a block table of another width (eager calls outside
DecodeBuffers) may pick another S of the same powers of two.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from pdserve.kernels import decode_attention_sum_triton as sums
from pdserve.kernels.decode_attention_sum_triton import combine_splits
from pdserve.kernels.fp8 import cache_strides, is_fp8
from pdserve.kernels.fp8_triton import fp8_v_tile, tile_pages
from pdserve.kernels.pdl import launch_options

_LOG2E = 1.4426950408889634
_MIN_SPLIT_TOKENS = 256  # below this a split's fixed costs (q load, reduction) outweigh its parallelism


@triton.jit
def _e4m3_bits_to_f16(x):
    """e4m3 codes (uint8) -> fp16 of value / 256, exactly, by moving bits: sign to bit 15, exponent and mantissa
    to bits 13..7 (e4m3's bias 7 read with fp16's 15 is the 2^-8; e4m3 subnormals land on fp16 subnormals)."""
    x = x.to(tl.uint16)
    return (((x & 0x80) << 8) | ((x & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _token_rows(table, offs_n, n_mask, stride_cblk, stride_ctok, PAGE: tl.constexpr):
    """Each key's row offset in the cache: its page from the block table (one entry read per key)."""
    page = tl.load(table + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
    return page * stride_cblk + (offs_n % PAGE) * stride_ctok


@triton.jit(do_not_specialize=["num_splits"])  # SINGLE and the part strides carry it
def _decode_split_kernel(
    q_ptr, cache_ptr, seq_lens_ptr, block_tables_ptr, out_ptr, part_out_ptr, part_lse_ptr, ticket_ptr,
    qk_scale, v_scale, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    stride_ckv, stride_cblk, stride_ctok, stride_ch,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, SINGLE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, F16_DOT: tl.constexpr,
    FMA: tl.constexpr, K_T: tl.constexpr, PAGE_ROWS: tl.constexpr, BITS: tl.constexpr, V_WIDE: tl.constexpr,
    V_T: tl.constexpr = False, COMBINE: tl.constexpr = False, BLOCK_H: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    # q: [B, Hq, D]; cache: [2, num_blocks, PAGE, Hkv, D]; block_tables: [B, max_blocks]
    # F16_DOT (an fp8 cache, bf16 queries): q and the fp8 K/V meet in fp16, e4m3's native widening on sm90
    # out: [B, Hq, D] (SINGLE) or part_out: [B, Hq, S, D] fp32 + part_lse: [B, Hq, S] fp32, which with COMBINE
    # the last of a (sequence, kv head)'s S programs to finish sums into out (ticket_ptr: [B * Hkv] int32, zero)
    if PDL:  # kernels/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gd_mask, other=0.0)
    qf = q.to(tl.float32)  # FMA: the query as loaded, in fp32
    if F16_DOT:
        q = q.to(tl.float16)
    k_base = cache_ptr + kv_head * stride_ch
    v_base = k_base + stride_ckv
    table = block_tables_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if PAGE_ROWS:  # one table entry per page of the tile (n0 is page-aligned: BLOCK_N is a multiple of PAGE)
            pages, _ = tile_pages(table, n0, end, PAGE, BLOCK_N)
            rows = tl.reshape(pages[:, None] * stride_cblk + tl.arange(0, PAGE)[None, :] * stride_ctok, [BLOCK_N])
        else:
            rows = _token_rows(table, offs_n, n_mask, stride_cblk, stride_ctok, PAGE)  # [BLOCK_N]
        kv_mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
        if K_T:  # K loaded as [BLOCK_D, BLOCK_N]: the dot's right operand as it is
            kt = tl.load(k_base + rows[None, :] + d[:, None], mask=(d < HEAD_DIM)[:, None] & n_mask[None, :], other=0.0)
            if BITS:
                kt = _e4m3_bits_to_f16(kt)
            if FMA:
                s = tl.sum(qf[:, :, None] * kt.to(tl.float32)[None, :, :], axis=1)
            else:
                s = tl.dot(q, kt.to(q.dtype), input_precision=PRECISION)
        else:
            k = tl.load(k_base + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            if BITS:
                k = _e4m3_bits_to_f16(k)
            if FMA:
                s = tl.sum(qf[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            else:
                s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))  # [BLOCK_G, BLOCK_N], log2 domain
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_T:  # an fp8 cache's V, [Hkv, D, PAGE] a block, a page's tokens one load (kernels/fp8_triton.py)
            v = fp8_v_tile(cache_ptr + stride_ckv + kv_head * (HEAD_DIM * PAGE), table, n0, end, stride_cblk, d,
                           HEAD_DIM, PAGE, BLOCK_N, BLOCK_D)
        else:
            v = tl.load(v_base + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if BITS:
            v = _e4m3_bits_to_f16(v)
        if FMA:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        else:
            v = v.to(q.dtype)
            if V_WIDE:  # a select after the widening: Triton does not move the conversion past it (docstring)
                v = tl.where(n_mask[:, None], v, 0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    has_keys = l_i > 0
    acc = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[:, None]
    if SINGLE:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        p_ptrs = part_out_ptr + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + split * stride_ps
        tl.store(p_ptrs + d[None, :], acc, mask=gd_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=g < GROUP)
        if COMBINE:  # one launch: the split that finishes last sums them all, then puts the ticket back to 0
            tl.debug_barrier()  # every thread's stores before the ticket: its release covers them
            ticket = ticket_ptr + b * tl.num_programs(1) + kv_head
            if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                first = kv_head * GROUP
                combine_splits(part_out_ptr + b.to(tl.int64) * stride_pb + first * stride_ph,
                               part_lse_ptr + b.to(tl.int64) * stride_lb + first * stride_lh,
                               out_ptr + b.to(tl.int64) * stride_ob + first * stride_oh, num_splits,
                               stride_ph, stride_ps, stride_lh, stride_oh, GROUP, HEAD_DIM, BLOCK_H, BLOCK_D)
                tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter runs: behave as on the H200 this was tuned on


def num_splits_for(batch: int, kv_heads: int, max_context: int, sm_count: int) -> int:
    """Splits per (sequence, kv head): none once B * Hkv programs fill every SM, else enough for ~2 programs
    per SM, rounded up to a power of two. H200, 32/8 heads, ctx 4096, CUDA-graph times over all splits x tiles:
    B 32 best unsplit (126.5 us, 4.25 TB/s), B 8 best 8 splits (38.4 us), B 1 best 16 (12.6 us)
    (python benchmarks/kernels.py --sweep --only decode)."""
    programs = max(1, batch * kv_heads)
    if programs >= sm_count:
        return 1
    want = triton.next_power_of_2(math.ceil(2 * sm_count / programs))
    return max(1, min(want, max_context // _MIN_SPLIT_TOKENS, 64))


def fp8_plan(batch: int, kv_heads: int, max_context: int, sm_count: int) -> tuple[int, tuple[int, int, int]]:
    """An fp8 cache's split count and tile (BLOCK_N, warps, stages) for the default variant. Below one program
    per SM, num_splits_for's splits with _FP8_TILE; from there on, _FP8_MANY_TILE split until
    ~_FP8_PROGRAMS_PER_SM programs a SM. Both are two-warp tiles of 64 keys in three stages since 2026-12-06 (the
    few-programs one was 128x4x1, the many-programs one 64x2x1). H100, one layer B 64 ctx 4,096 (512
    programs; the sweep in benchmarks/decode_attention_fp8_gpu.py --splits, one-stage tiles): 128x4x1 unsplit
    197.6 us, 64x2x1 unsplit 228.0, split in 2 190.6, in 4 197.3; at ctx 512 32.5 against 33.4; at B 1 the wide
    tile wins (13.0 against 64x2x1's 16.6). Three stages (H200, 2026-12-06, results/decode_attention_fp8_stages_h200.json):
    a one-stage tile issues V's loads only after the softmax's barriers, so each tile waits for memory twice;
    Triton's pipeline, three stages deep, has the next tiles' K and V in flight meanwhile (two stages were no
    better than one: their copies are issued at the end of a tile and waited for at the top of the next). At B 64
    ctx 4,096 split in 2, 64x2x3 132.0-132.2 us (4.07 TB/s, 85 % of DRAM) against 64x2x1's 152.8-154.4; B 128
    252.3 against 292.3; B 32 76.2 against 88.4 (split 4); B 64 ctx 512 25.5 against 29.1; 4 and 5 stages within
    1 % at B 64 and 128."""
    programs = max(1, batch * kv_heads)
    if _FP8_MANY_TILE is None or programs < sm_count:
        return num_splits_for(batch, kv_heads, max_context, sm_count), _FP8_TILE
    want = triton.next_power_of_2(math.ceil(_FP8_PROGRAMS_PER_SM * sm_count / programs))
    return max(1, min(want, max_context // _MIN_SPLIT_TOKENS, 64)), _FP8_MANY_TILE


def _check(q, kv_cache, seq_lens, block_tables):
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"q {tuple(q.shape)} must be [B, Hq, D], kv_cache {tuple(kv_cache.shape)} [2, N, bs, Hkv, D]")
    batch, q_heads, dim = q.shape
    kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != dim or q_heads % kv_heads:
        raise ValueError(f"q heads {q_heads} x dim {dim} do not fit kv_cache heads {kv_heads} x dim {kv_cache.shape[4]}")
    if seq_lens.shape != (batch,) or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} / block_tables {tuple(block_tables.shape)} need batch {batch}")
    if q.dtype != kv_cache.dtype and not is_fp8(kv_cache.dtype):
        raise ValueError(f"q dtype {q.dtype} != kv_cache dtype {kv_cache.dtype}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_tables need unit stride in their last dim")


VARIANTS = ("dot", "kt", "pages", "kt+pages", "bits", "kt+bits", "bits+pages", "fma", "fma+kt", "fma+pages",
            "fma+kt+pages", "fma+bits", "vwide", "kt+vwide", "kt+pages+vwide")
_FP8_VARIANT = "kt"  # an fp8 cache's default: the sweep's fastest (benchmarks/decode_attention_fp8_gpu.py)
_FP8_TILE = (64, 2, 3)  # and its (BLOCK_N, num_warps, num_stages) below one program a SM (was 128x4x1; H100 B 4 / 8 / 16
# ctx 4,096 21.0 / 32.6 / 55.1 us against 24.6 / 34.5 / 60.6, B 1 13.1 against 13.0: results/decode_attention_fp8_few_h100.json)
_FP8_MANY_TILE: tuple[int, int, int] | None = (64, 2, 3)  # once B * Hkv programs fill the SMs: two-warp programs,
_FP8_PROGRAMS_PER_SM = 6  # split until B * Hkv * S reaches this many a SM (fp8_plan; None: _FP8_TILE throughout)


def _variant_flags(variant: str, page: int, block_n: int, fp8: bool) -> tuple[bool, bool, bool, bool, bool]:
    """FMA, K_T, PAGE_ROWS, BITS, V_WIDE of a variant name: "dot" (tl.dot for QK and PV, K transposed in
    registers) plus any of "fma" (both products as fp32 broadcast-multiply-reduce, the group unpadded), "kt" (K loaded as
    [D, BLOCK_N]), "pages" (one block-table load per page of the tile, not per token; needs PAGE | BLOCK_N),
    "bits" (an fp8 cache read as uint8 and widened to fp16 / 256 by bit moves; the 256 goes into the scales),
    "vwide" (an fp8 V tile widened in registers as loaded, then laid out for the dot as fp16)."""
    parts = set(variant.split("+")) - {"dot"}
    if variant not in VARIANTS:
        raise ValueError(f"decode attention variant {variant!r} not in {VARIANTS}")
    pages = "pages" in parts and block_n % page == 0 and page & (page - 1) == 0
    return "fma" in parts, "kt" in parts, pages, "bits" in parts and fp8, "vwide" in parts and fp8


def _launch(q, kv_cache, seq_lens, block_tables, scale, num_splits=None, config=None, k_scale=1.0, v_scale=1.0,
            f16_dot=None, variant=None):
    _check(q, kv_cache, seq_lens, block_tables)
    batch, q_heads, dim = q.shape
    kv_heads, page = kv_cache.shape[3], kv_cache.shape[2]
    group = q_heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    chosen = config is None  # an explicit tile is taken as it is (or refused); the defaults hold whole pages
    if variant is None and chosen and num_splits is None and is_fp8(kv_cache.dtype) and q.dtype != torch.float32:
        num_splits, config = fp8_plan(batch, kv_heads, block_tables.shape[1] * page, _sm_count(q.device))
    if num_splits is None:
        num_splits = num_splits_for(batch, kv_heads, block_tables.shape[1] * page, _sm_count(q.device))
    # fp32 (tests only) runs its exact dots on the FMA units: a small tile keeps it out of local memory
    # an fp8 cache: twice the tokens a tile for the same bytes in flight (benchmarks/decode_attention_fp8_gpu.py)
    # fma: [GROUP, BLOCK_N, D] fp32 products in registers, so a short tile
    if variant is None:
        variant = _FP8_VARIANT if is_fp8(kv_cache.dtype) else "dot"
    block_n, num_warps, num_stages = config or ((16, 4, 1) if q.dtype == torch.float32 else
                                                (32, 4, 2) if variant.startswith("fma") else
                                                _FP8_TILE if is_fp8(kv_cache.dtype) else (64, 4, 3))
    v_t = is_fp8(kv_cache.dtype)  # the fp8 layout's V, [Hkv, D, PAGE] a block (kernels/fp8.py), read a page a row
    if v_t and chosen:
        block_n = max(block_n, page)
    if v_t and block_n % page:
        raise ValueError(f"an fp8 cache's tile of {block_n} keys must hold whole pages of {page}")
    fma, k_t, page_rows, bits, v_wide = _variant_flags(variant, page, block_n, v_t)
    strides = cache_strides(kv_cache)  # an fp8 cache's K head-major (kernels/fp8.py)
    if bits:
        kv_cache, k_scale, v_scale = kv_cache.view(torch.uint8), k_scale * 256.0, v_scale * 256.0
    block_d = triton.next_power_of_2(dim)
    single = num_splits == 1
    if f16_dot is None:  # e4m3 -> fp16 is one instruction per pair on sm90, -> bf16 goes through fp32
        f16_dot = is_fp8(kv_cache.dtype) and q.dtype == torch.bfloat16
    part_out = out if single else torch.empty((batch, q_heads, num_splits, dim), dtype=torch.float32, device=q.device)
    part_lse = out if single else torch.empty((batch, q_heads, num_splits), dtype=torch.float32, device=q.device)
    many = batch * kv_heads >= _sm_count(q.device)
    tickets = sums.ticket_buffer(q.device, batch * kv_heads) if many and not single and sums.COMBINE_IN_SPLITS else None
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, kv_cache, seq_lens, block_tables, out, part_out, part_lse, out if tickets is None else tickets,
        scale * _LOG2E * k_scale, v_scale, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *strides, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HEAD_DIM=dim, PAGE=page, SINGLE=single, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_G=triton.next_power_of_2(group) if fma else max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=block_d, F16_DOT=f16_dot, FMA=fma, K_T=k_t, PAGE_ROWS=page_rows, BITS=bits, V_WIDE=v_wide, V_T=v_t,
        COMBINE=tickets is not None, BLOCK_H=triton.next_power_of_2(group), num_warps=num_warps,
        num_stages=num_stages, **launch_options(q.device),
    )
    if not single and tickets is None:
        sums.reduce_splits(part_out, part_lse, out, num_splits)
    return out


def decode_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    if not is_fp8(kv_cache.dtype):  # scales belong to fp8 caches only (kernels/fp8.py)
        k_scale = v_scale = 1.0
    return _launch(q, kv_cache, seq_lens, block_tables, scale, k_scale=k_scale, v_scale=v_scale)
