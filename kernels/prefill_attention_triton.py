"""Triton varlen causal prefill attention (FlashAttention-2 style) reading K/V from the paged cache.

    grid (Hq, cdiv(T, BLOCK_M) + B): sequence i owns tiles first_i .. first_i + cdiv(q_len_i, BLOCK_M) - 1,
        first_i = cu[i] // BLOCK_M + i      (strictly increasing; first_{i+1} - first_i >= cdiv(q_len_i, BLOCK_M))
    a program finds its sequence by counting the first_i <= its tile (SEARCH entries of cu per step); the
    tiles between one sequence's last and the next one's first (at most B in all) exit at once.
    sequence i, query tile t, head h: rows cu[i] + t*BLOCK_M ..., at positions prefix_i + t*BLOCK_M + r;
    each sequence's last (heaviest) tile runs first

    keys  0 ............ full_end ........ last_key          full_end = (first row's position + 1) // BLOCK_N * BLOCK_N
          |  every row sees  |  causal mask  |               loop 1 runs without masks, loop 2 masks k > pos
          +------------------+---------------+

K/V rows come from the block table (token n lives in block table[n // PAGE] at offset n % PAGE), so a cached
prefix before the chunk needs nothing special: prefix_i = seq_len_i - q_len_i. GQA: head h reads kv head
h // GROUP; consecutive programs are consecutive heads, so a group's K/V tile is read once from DRAM and
then from L2. The sequence/tile lookup is done on the device from cu_seqlens (no host sync).

An fp8 cache (float8_e4m3fn) is loaded as fp8 and converted to the query's dtype in registers (exact for bf16
and fp16 queries); the K scale is folded into qk_scale, the V scale multiplies the output once, so the dots and
the fp32 accumulation are those of a bf16 cache.

What is compiled (issue 23: no compile after start). The constexprs are the model's (GROUP, HEAD_DIM, PAGE),
the dtype's (PRECISION) and the tile config's (BLOCK_M, BLOCK_N, num_warps, num_stages, from
`_default_config`: on the GPU two configs for bf16/fp16 with head_dim <= 128, chosen by the token count, one
otherwise); SEARCH is fixed. The per-batch integers (num_seqs, the block table's row stride) are marked
do_not_specialize, so Triton's `== 1` / `% 16` classes do not multiply the kernels; the other strides are the
model's. `out` is allocated contiguous, so its strides do not follow q's view (a 1-token q is "dense" and
would otherwise pass its parent's row stride). So a served batch reaches at most two compiled kernels per
model and dtype, whatever its sequence count or lengths.
"""

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8 import cache_strides, is_fp8
from pdserve.kernels.fp8_triton import fp8_v_tile

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(
    acc, l_i, m_i, q, k_base, v_base, table, n0, pos, seq_len, qk_scale, stride_cblk, stride_ctok,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, V_T: tl.constexpr,
):
    # q: [BLOCK_M, BLOCK_D]; keys n0 .. n0 + BLOCK_N; acc: [BLOCK_M, BLOCK_D]; l_i, m_i, pos: [BLOCK_M]
    offs_n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    if MASKED:
        n_ok = offs_n < seq_len
        page = tl.load(table + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
    else:
        page = tl.load(table + offs_n // PAGE).to(tl.int64)
    rows = (page * stride_cblk + (offs_n % PAGE) * stride_ctok)[:, None] + d[None, :]  # [BLOCK_N, BLOCK_D]
    if MASKED:
        kv_mask = n_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_base + rows, mask=kv_mask, other=0.0).to(q.dtype)
        if not V_T:
            v = tl.load(v_base + rows, mask=kv_mask, other=0.0).to(q.dtype)
    elif BLOCK_D != HEAD_DIM:
        k = tl.load(k_base + rows, mask=(d < HEAD_DIM)[None, :], other=0.0).to(q.dtype)
        if not V_T:
            v = tl.load(v_base + rows, mask=(d < HEAD_DIM)[None, :], other=0.0).to(q.dtype)
    else:
        k = tl.load(k_base + rows).to(q.dtype)  # a no-op unless the cache is fp8
        if not V_T:
            v = tl.load(v_base + rows).to(q.dtype)
    if V_T:  # an fp8 cache's V, [Hkv, D, PAGE] a block (kernels/fp8_triton.py; v_base is the head's; n0 is
        # page-aligned, keys past the end get p = 0)
        v = fp8_v_tile(v_base, table, n0, seq_len, stride_cblk, d, HEAD_DIM, PAGE, BLOCK_N, BLOCK_D).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where((offs_n[None, :] <= pos[:, None]) & n_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
    else:  # scale folded into one FMA with the max subtraction (qk_scale > 0, so max commutes with it)
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])  # per-batch values: one kernel for every batch
def _prefill_attention_kernel(
    q_ptr, cache_ptr, cu_q_ptr, seq_lens_ptr, block_tables_ptr, out_ptr, qk_scale, v_scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_ckv, stride_cblk, stride_ctok, stride_ch,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SEARCH: tl.constexpr,
    V_T: tl.constexpr = False,
):
    # q, out: [T, Hq, D]; cu_q: [B + 1]; seq_lens: [B]; block_tables: [B, max_blocks]
    # cache: [2, num_blocks, PAGE, Hkv, D]; grid: (Hq, cdiv(T, BLOCK_M) + B)
    head = tl.program_id(0)
    tile = tl.program_id(1)
    # sequence = (number of first_i <= tile) - 1; its rows start at the largest such cu[i], end at cu[i + 1]
    found = tl.zeros([SEARCH], tl.int32)
    q_start = tl.zeros([SEARCH], tl.int32)
    q_end = tl.zeros([SEARCH], tl.int32)
    for s0 in range(0, num_seqs, SEARCH):
        i = s0 + tl.arange(0, SEARCH)
        lo = tl.load(cu_q_ptr + i, mask=i < num_seqs, other=0)
        hi = tl.load(cu_q_ptr + i + 1, mask=i < num_seqs, other=0)
        mine_or_before = (lo // BLOCK_M + i <= tile) & (i < num_seqs)
        found += mine_or_before.to(tl.int32)
        q_start = tl.maximum(q_start, tl.where(mine_or_before, lo, 0))
        q_end = tl.maximum(q_end, tl.where(mine_or_before, hi, 0))
    seq = tl.sum(found, axis=0) - 1  # >= 0: first_0 = 0 <= tile
    q_start = tl.max(q_start, axis=0)
    q_len = tl.max(q_end, axis=0) - q_start
    n_tiles = tl.cdiv(q_len, BLOCK_M)
    local = tile - (q_start // BLOCK_M + seq)
    if local < n_tiles:
        m_tile = n_tiles - 1 - local
        seq_len = tl.load(seq_lens_ptr + seq)
        first_pos = seq_len - q_len + m_tile * BLOCK_M

        offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        md_mask = (offs_m < q_len)[:, None] & (d < HEAD_DIM)[None, :]
        tokens = (q_start + offs_m).to(tl.int64)[:, None]
        q = tl.load(q_ptr + tokens * stride_qt + head * stride_qh + d[None, :], mask=md_mask, other=0.0)
        pos = first_pos + tl.arange(0, BLOCK_M)
        k_base = cache_ptr + (head // GROUP) * stride_ch
        if V_T:  # an fp8 cache's V: [Hkv, D, PAGE] a block (kernels/fp8.py)
            v_base = cache_ptr + stride_ckv + (head // GROUP) * (HEAD_DIM * PAGE)
        else:
            v_base = k_base + stride_ckv
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, k_base, v_base, table, n0, pos, seq_len, qk_scale, stride_cblk, stride_ctok,
                False, HEAD_DIM, PAGE, PRECISION, BLOCK_N, BLOCK_D, V_T,
            )
        last_key = tl.minimum(first_pos + BLOCK_M, seq_len)
        for n0 in range(full_end, last_key, BLOCK_N):
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, k_base, v_base, table, n0, pos, seq_len, qk_scale, stride_cblk, stride_ctok,
                True, HEAD_DIM, PAGE, PRECISION, BLOCK_N, BLOCK_D, V_T,
            )
        out = acc * (v_scale / l_i)[:, None]
        o_ptrs = out_ptr + tokens * stride_ot + head * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=md_mask)


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots; tf32 would cost ~1e-2 relative error in the attention weights."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(q, kv_cache, cu_seqlens_q, seq_lens, block_tables):
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"q {tuple(q.shape)} must be [T, Hq, D], kv_cache {tuple(kv_cache.shape)} [2, N, bs, Hkv, D]")
    q_heads, dim = q.shape[1:]
    kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != dim or q_heads % kv_heads:
        raise ValueError(f"q heads {q_heads} x dim {dim} do not fit kv_cache heads {kv_heads} x dim {kv_cache.shape[4]}")
    if q.dtype != kv_cache.dtype and not is_fp8(kv_cache.dtype):
        raise ValueError(f"q dtype {q.dtype} != kv_cache dtype {kv_cache.dtype}")
    batch = seq_lens.shape[0]
    if cu_seqlens_q.shape != (batch + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} / block_tables {tuple(block_tables.shape)} need batch {batch}"
        )
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_tables need unit stride in their last dim")


def _default_config(dim: int, dtype: torch.dtype, device: torch.device, tokens: int, q_heads: int) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). 128-row tiles once they make >= 4 waves of programs, else
    64 to fill the SMs. H200, bf16, 32/8 heads, d 128: 4096 tokens m128/n128/8 warps 373 us (m128/n64/8 warps
    419, m64 378); 1024 tokens m64/n64/4 warps 40.7 us (m128 45-69); python benchmarks/kernels.py --sweep
    --only prefill. Triton 3.6's Hopper warp specialization (tl.range(warp_specialize=True)) fails to compile
    this kernel (NVGPUWarpSpecialization pass error), which is the main gap to SDPA (see benchmarks/results)."""
    if device.type != "cuda":
        return 64, 32, 4, 1
    if dtype == torch.float32:  # exact fp32 dots run on the FMA units: small tiles keep registers in check
        return 32, 32, 4, 2
    if dim > 128:
        return 64, 32, 4, 2
    if triton.cdiv(tokens, 128) * q_heads >= 4 * 132:
        return 128, 128, 8, 3
    return 64, 64, 4, 3


_SEARCH = 128  # cu_seqlens entries a program compares per step: one step for up to 128 sequences


def _launch(q, kv_cache, cu_seqlens_q, seq_lens, block_tables, scale, config=None, k_scale=1.0, v_scale=1.0):
    _check(q, kv_cache, cu_seqlens_q, seq_lens, block_tables)
    tokens, q_heads, dim = q.shape
    batch = seq_lens.shape[0]
    out = torch.empty((tokens, q_heads, dim), dtype=q.dtype, device=q.device)
    if tokens == 0 or batch == 0:
        return out
    block_m, block_n, num_warps, num_stages = config or _default_config(dim, q.dtype, q.device, tokens, q_heads)
    v_t = is_fp8(kv_cache.dtype)  # the fp8 layout's V, read a page a row: a tile of whole pages
    block_n = max(block_n, kv_cache.shape[2]) if v_t else block_n
    grid = (q_heads, triton.cdiv(tokens, block_m) + batch)  # >= first_{B-1} + cdiv(q_len_{B-1}, BLOCK_M)
    _prefill_attention_kernel[grid](
        q, kv_cache, cu_seqlens_q, seq_lens, block_tables, out, scale * _LOG2E * k_scale, v_scale, batch,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), *cache_strides(kv_cache),
        GROUP=q_heads // kv_cache.shape[3], HEAD_DIM=dim, PAGE=kv_cache.shape[2], PRECISION=_precision(q.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(dim), SEARCH=_SEARCH, V_T=v_t,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def prefill_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    if not is_fp8(kv_cache.dtype):  # scales belong to fp8 caches only (kernels/fp8.py)
        k_scale = v_scale = 1.0
    return _launch(q, kv_cache, cu_seqlens_q, seq_lens, block_tables, scale, k_scale=k_scale, v_scale=v_scale)
