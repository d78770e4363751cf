"""Triton GEMV / skinny GEMM for decode-sized batches, and the shape-based choice between it and cuBLAS.

    y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M <= 16
    grid (cdiv(N, BLOCK_N), SPLIT_K): program (n, s) streams W[n*BLOCK_N : +BLOCK_N, s*k_per_split : +k_per_split]
    SPLIT_K == 1: writes y directly;  SPLIT_K > 1: fp32 partials [SPLIT_K, M, N], summed by a second kernel

Why a second kernel: summing the partials in each tile's last program instead (an int32 ticket per tile taken
with an acq_rel atomic after a barrier, the last program reading the partials back and resetting its ticket: one
launch) was built and measured on the H200 (commit feb5a85, benchmarks/results/split_k_fixup_ab_h200.json, the
engine's decode rows with and without it in one run): fp8 linears b1 ctx512 3.27 -> 3.24 ms, b8 3.54 -> 3.58,
b64 4.97 -> 5.22; bf16 linears 4.59 -> 4.60, 6.59 -> 6.59. A reduce launch inside a CUDA graph costs less than
the serial tail it moves into the product (the last program's reads of every split), so the reduce kernel stays.

At these batch sizes the product is a pass over W (2 bytes a weight, ~0.03 FLOP a byte at M = 1): the job is
to keep enough of W in flight (cp.async, 4-6 stages). Where a tuned Triton config beats cuBLAS for a
(N, K, batch bucket, dtype, device) it is recorded in linear_configs.json (kernels/tuning.py) and used here,
elsewhere torch.matmul runs (FlashDecoding++'s "choose the kernel by shape" idea). H200, bf16, CUDA-graph
replay on rotated weights: 4096->14336 and 14336->4096 at M 1-8 run at 3.84-3.96 TB/s, 1.07-1.10x cuBLAS;
the fused 4096->28672 stays on cuBLAS (python benchmarks/kernels.py --only gemv, 2026-11-29).

What is compiled: per weight shape (N, K) and dtype, one kernel per batch bucket of tuning.BATCH_BUCKETS
(1, 2, 4, 8, 16): the config (BLOCK_N, BLOCK_K, SPLIT_K, USE_DOT, warps, stages) is looked up by bucket, and
BLOCK_M is 16 (dot) or the bucket's power of two (FMA path), so rows 3 and 4 share a kernel. M and the split
partials' stride (M * N) are do_not_specialize; N, K, k_per_split and EVEN are the weight's. Rows above 16 go
to cuBLAS, which compiles nothing: at 32 and 64 rows this kernel (any power-of-two BLOCK_M, best of 48 configs)
only ties it, cuBLAS taking 1.004x and 1.015x its time over a llama3-8b layer's four products and 1.06-1.08x on
lm_head (H100, 2026-12-06, `python benchmarks/gemv_wide_rows_gpu.py`, results/gemv_wide_rows_h100.json), so the
limit stays. The prefill warm-up runs every bucket (engine/prefill_warm_up.py).
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.pdl import launch_options, prefetch_l2, weight_prefetch_bytes
from pdserve.kernels.tuning import default_table, device_name

MAX_TRITON_BATCH = 16


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 16
    block_k: int = 512
    split_k: int = 1
    use_dot: bool = True  # tensor-core dot with the batch padded to 16 rows; else fp32 FMAs (exact for fp32)
    num_warps: int = 4
    num_stages: int = 4


@triton.jit(do_not_specialize=["M", "stride_ps"])  # per-batch values (stride_ps = M * N): one kernel per bucket
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om, stride_ps,
    HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, EVEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
):
    # x: [M, K]; w: [N, K]; out: [M, N]; part: [SPLIT_K, M, N] fp32; grid: (cdiv(N, BLOCK_N), SPLIT_K)
    # SCALED: w is fp8 with scale [N] fp32 (kernels/fp8_weight.py), upcast to x's dtype in registers
    # PREFETCH: bytes of each of the program's W rows fetched into L2 before the PDL wait (kernels/pdl.py)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH > 0:
        rows = w_ptr + (offs_n % N).to(tl.int64) * stride_wn + pid_k * k_per_split
        prefetch_l2(rows, tl.minimum(PREFETCH, (K - pid_k * k_per_split) * w_ptr.dtype.element_ty.primitive_bitwidth // 8))
    if PDL:  # kernels/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = pid_k * k_per_split + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        if EVEN:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=offs_m[:, None] < M, other=0.0)
        else:
            k_ok = (offs_k + k0 < K)[None, :]
            w = tl.load(w_ptrs, mask=(offs_n < N)[:, None] & k_ok, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & k_ok, other=0.0)
        if SCALED:
            w = w.to(x_ptr.dtype.element_ty)
        if USE_DOT:
            acc = tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision=PRECISION)
        else:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if not USE_DOT:
        acc = tl.sum(acc, axis=2)
    if SCALED:  # per output channel, so it commutes with the split-K sum
        acc *= tl.load(scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    mn_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k * stride_ps + offs_m[:, None] * N + offs_n[None, :], acc, mask=mn_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mn_mask)


@triton.jit(do_not_specialize=["stride_ps"])  # M * N
def _split_k_reduce_kernel(
    part_ptr, bias_ptr, out_ptr, N, split_k, stride_ps, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    # part: [SPLIT_K, M, N] fp32 -> out: [M, N]; grid: (M, cdiv(N, BLOCK))
    if PDL:  # kernels/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(split_k):
        acc += tl.load(part_ptr + s * stride_ps + m * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemv_triton(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: GemvConfig,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """x2: [M, K] (M <= 16, unit stride along K); weight: [N, K] contiguous rows -> [M, N] in x2's dtype.
    scale: [N] fp32 when weight is fp8 (its per-channel scales), else None."""
    m, k = x2.shape
    n = weight.shape[0]
    if m > MAX_TRITON_BATCH:
        raise ValueError(f"the GEMV kernel takes at most {MAX_TRITON_BATCH} rows, got {m}")
    if weight.stride(1) != 1 or x2.stride(1) != 1:
        raise ValueError(f"x {x2.stride()} and weight {weight.stride()} need unit stride along K")
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    k_per_split, split_k = split_k_layout(k, cfg.split_k, cfg.block_k)
    even = n % cfg.block_n == 0 and k_per_split * split_k == k
    part = torch.empty((split_k, m, n), dtype=torch.float32, device=x2.device) if split_k > 1 else out
    block_m = max(16, triton.next_power_of_2(m)) if cfg.use_dot else triton.next_power_of_2(m)
    bias_arg = bias if bias is not None else out
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), split_k)](
        x2, weight, scale if scale is not None else out, bias_arg, out, part, m, n, k, k_per_split,
        x2.stride(0), weight.stride(0), out.stride(0), part.stride(0),
        HAS_BIAS=bias is not None, SCALED=scale is not None, SPLIT=split_k > 1, USE_DOT=cfg.use_dot, EVEN=even,
        PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x2.device),
        PREFETCH=weight_prefetch_bytes("gemv", x2.device, weight, k, k_per_split,
                                       cfg.block_k * cfg.num_stages * weight.element_size()),
    )
    if split_k > 1:
        reduce_split_k(part, bias, out)
    return out


def split_k_layout(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(K per split, a multiple of block_k; the number of splits, none of them empty)."""
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return k_per_split, triton.cdiv(k, k_per_split)


def reduce_split_k(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] = sum over S of the fp32 partials part [S, M, N] (+ bias [N])."""
    m, n = out.shape
    block = min(1024, triton.next_power_of_2(n))
    _split_k_reduce_kernel[(m, triton.cdiv(n, block))](
        part, bias if bias is not None else out, out, n, part.shape[0], part.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **launch_options(out.device),
    )


def heuristic_config(m: int, n: int, k: int, dtype: torch.dtype) -> GemvConfig:
    """Untuned shapes: ~2 programs per SM (of 132) over W; FMAs for fp32, whose tf32 dots would lose precision,
    with the [M, BLOCK_N, BLOCK_K] fp32 accumulator held to 8K elements (64 registers a thread)."""
    split_k = max(1, min(8, (2 * 132 * 16) // max(n, 1)))
    if dtype == torch.float32:
        return GemvConfig(split_k=split_k, use_dot=False, block_k=max(16, 8192 // (16 * triton.next_power_of_2(m))))
    return GemvConfig(split_k=split_k)


@functools.lru_cache(maxsize=1024)  # the launch path runs per layer per step: look each shape up once
def choose_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> GemvConfig | None:
    """The Triton config for this shape, or None where torch.matmul (cuBLAS) is the faster choice."""
    if m == 0 or m > MAX_TRITON_BATCH:
        return None
    entry = default_table().lookup(device_name(device), dtype, n, k, m)
    if entry is None:
        return heuristic_config(m, n, k, dtype)
    return None if entry.get("backend") == "torch" else GemvConfig(**entry["config"])


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} must be [N, K={k}]")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [N={weight.shape[0]}]")
    x2 = x.reshape(-1, k)
    cfg = choose_config(x2.shape[0], weight.shape[0], k, x.dtype, x.device)
    if cfg is None or weight.stride(1) != 1:
        return torch.nn.functional.linear(x, weight, bias)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return gemv_triton(x2, weight, bias, cfg).view(*x.shape[:-1], weight.shape[0])
