"""Triton kernels of the fp8 linear (kernels/linear_fp8.py): per-row activation quantization, the W8A8 GEMM,
and the launcher that picks them, the skinny W8A8 kernel or the fp8-weight GEMV by batch rows.

    M <= FP8_WEIGHT_ONLY_MAX_ROWS (0):  gemv_triton(x, Wq, scale=s)      x in its dtype, Wq upcast in registers
    above it:                           xq, sx = quantize_rows_fp8_triton(x)   per row: amax pass, scale-and-cast pass
      M <= SKINNY_MAX_ROWS (64):        fp8_skinny_triton(xq, sx, Wq)    swapped operands, split-K (decode batches:
                                                                         kernels/linear_fp8_skinny_triton.py),
                                                                         where its table does not name the GEMM
      else:                             fp8_gemm_triton(xq, sx, Wq, s)   y = (xq Wq^T) * sx[m] * s[n] (+ b[n])
    x an Fp8Activation:                 (xq, sx) as given, the same two products by M

The GEMM: grid cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) in GROUP_M-row super-groups (programs sharing W tiles run
together, for L2); each program keeps a [BLOCK_M, BLOCK_N] fp32 accumulator and `tl.dot`s e4m3 tiles, which
on sm90 are wgmma fp8 instructions (both operands K-major, as W [N, K] and x [M, K] are). Rows and columns
past M, N are read modulo M, N (no masks in the loop) and not stored. The activation quantization is a pass of
its own over x [M, K] for a plain tensor x; the engine's norms and SiLU-and-mul quantize in their own pass
instead where an fp8 linear follows (rms_norm_fp8, silu_and_mul_fp8: kernels/fp8_activation.py), which saves
that kernel and one write and read of x in bf16.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8_activation import Fp8Activation
from pdserve.kernels.fp8_weight import FP8_DTYPE, FP8_MAX, Fp8Weight
from pdserve.kernels.linear_fp8 import check_quantized_rows, quantizes_activations
from pdserve.kernels.linear_fp8_skinny_triton import SKINNY_MAX_ROWS, fp8_skinny_triton, skinny_config
from pdserve.kernels.linear_triton import GemvConfig, gemv_triton
from pdserve.kernels.pdl import launch_options


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4


ONE_PASS_MAX_K = 16384  # a row up to this wide is held in registers (32 fp32 a thread at 16 warps) and read once


@triton.jit
def _round_to_e4m3(v):
    # v: fp32 within [-448, 448] -> the nearest e4m3 value (ties to even), still fp32, so that the cast to fp8
    # after it is exact. Triton 3.8's interpreter casts fp32 -> e4m3 without carrying a rounded-up mantissa
    # into the exponent (1.95 -> 1.0, 125 -> 64); rounding here first gives it torch's codes. Compiled kernels
    # skip it: the GPU's fp32 -> e4m3 cvt rounds to nearest even. The magnitude is rounded and v's sign bit put
    # back, so that a value rounding to zero keeps its sign (-0 is code 0x80, as torch casts it).
    bits = v.to(tl.int32, bitcast=True)
    exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # below 2^-6 the subnormals' step is 2^-9, as at 2^-6
    step = ((exp - 3) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): 3 mantissa bits
    u = tl.abs(v) / step  # exact (a power of two); u < 16
    r = ((u + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: the fp32 add rounds u to an integer, to even
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["M"])
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, FP8_MAX: tl.constexpr,
                          BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, ROUND: tl.constexpr,
                          PDL: tl.constexpr = False):
    # x: [M, K] -> q: [M, K] e4m3, s: [M] fp32; grid: (M,). ONE_PASS: the row fits one block (BLOCK_K >= K) and
    # is read once; else an amax pass and a scale-and-cast pass. ROUND: round in fp32 before the cast (the
    # interpreter's cast rounds wrongly; a GPU's cvt rounds to nearest even itself)
    if PDL:  # kernels/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:
        offs = tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / FP8_MAX
        tl.store(s_ptr + row, scale)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        if ROUND:
            q = _round_to_e4m3(q)
        tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
            q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
            if ROUND:
                q = _round_to_e4m3(q)
            tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # This program's tile of an [M, N] output on a grid of cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) programs, taken in
    # GROUP_M-row super-groups (programs sharing W's column tiles run together, for L2) -> (offs_m, offs_n): its
    # rows and columns; (rm, rn): the same modulo M, N, to read past the edges without masks
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
    rn = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    return offs_m, offs_n, rm, rn


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # a: [M, K] e4m3, a_scale: [M]; b: [N, K] e4m3, b_scale: [N]; c: [M, N]; grid: (cdiv(M, BM) * cdiv(N, BN),)
    offs_m, offs_n, rm, rn = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + rn.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = (offs_k + k0 < K)[None, :]
            a = tl.load(a_ptrs, mask=k_ok, other=0.0)
            b = tl.load(b_ptrs, mask=k_ok, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc *= tl.load(a_scale_ptr + rm)[:, None] * tl.load(b_scale_ptr + rn)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def quantize_rows_fp8_triton(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] (unit stride along K) -> (xq [M, K] e4m3, scale [M] fp32), as quantize_rows_fp8_ref."""
    m, k = x2.shape
    if x2.stride(1) != 1:
        raise ValueError(f"x {tuple(x2.shape)} needs unit stride along K, has strides {x2.stride()}")
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x2.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x2.device)
    if m:
        width = triton.next_power_of_2(k)
        one_pass = width <= ONE_PASS_MAX_K
        _quantize_rows_kernel[(m,)](x2, q, scale, m, k, x2.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                    BLOCK_K=width if one_pass else 4096, ONE_PASS=one_pass,
                                    ROUND=x2.device.type != "cuda", num_warps=8 if width <= 4096 else 16,
                                    **launch_options(x2.device))
    return q, scale


def fp8_gemm_triton(xq: torch.Tensor, x_scale: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None,
                    out_dtype: torch.dtype, cfg: Fp8GemmConfig | None = None) -> torch.Tensor:
    """xq [M, K] e4m3 with x_scale [M]; weight [N, K] -> [M, N] in out_dtype."""
    m, k = xq.shape
    n = weight.shape[0]
    if weight.shape[1] != k or xq.stride(1) != 1 or weight.weight.stride(1) != 1:
        raise ValueError(f"x {tuple(xq.shape)} and weight {tuple(weight.shape)} must share K with unit stride")
    cfg = cfg or gemm_config(m, n, k)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_gemm_kernel[grid](
        xq, weight.weight, x_scale, weight.scale, bias if bias is not None else out, out, m, n, k,
        xq.stride(0), weight.weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def gemm_config(m: int, n: int, k: int) -> Fp8GemmConfig:
    """Untuned, picked from benchmarks/linear_fp8_gpu.py's sweep on the H200 at llama3-8b's shapes
    (benchmarks/results/linear_fp8_h200.json): 64 x 32 x 256 tiles at 64 rows (qkv, o, down: 47, 44, 56 us
    against 76, 45, 64 us for 64 x 64 x 128), 64 x 128 x 128 for gate_up's 28,672 columns; 128 x 256 x 128 for
    prefill (4,096 rows: 191, 138, 828, 362 us, 2-6 % behind torch._scaled_mm; 128 x 128 x 128: 222, 152, 874,
    397 us). cuBLASLt's fp8 GEMM (torch._scaled_mm, row-wise scales) is faster per call from 128 rows
    (benchmarks/fp8_scaled_mm_gpu.py as it was on 2026-12-02, eager-timed, results/fp8_scaled_mm_h200.json: a
    llama3-8b layer's four GEMMs 1.20x at 128 rows, 1.30x at 256, 1.34x at 512, 1.13x at 1,024, 1.04x at 2,048, 1.08x at 4,096), but
    dispatched to from 128 rows it did not make the engine's 4,096-token fp8 prefill faster: on / off
    alternated in one call (benchmarks/fp8_scaled_mm_ab_h200.sh at bf5927b) gave 67.99, 68.41 against 67.40,
    66.12 ms (not traced), so this GEMM runs at every size. Graph-timed on an H100 with x pre-quantized
    (2026-12-06, results/fp8_scaled_mm_graph_h100.json), a layer's four products against torch._scaled_mm: 0.70-0.80x
    its time up to 32 rows (the skinny kernel, before the H100 had its table), 1.00x at 64, 1.05x at 128, 1.17x
    at 512, 0.97x at 4,096."""
    if m <= 64:
        if n >= 16384:
            return Fp8GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4)
        return Fp8GemmConfig(block_m=64, block_n=32, block_k=256, num_warps=4, num_stages=4)
    if m <= 256:
        return Fp8GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4)
    return Fp8GemmConfig(block_m=128, block_n=256, block_k=128, num_warps=8, num_stages=3)


@functools.lru_cache(maxsize=1024)
def gemv_config(m: int, n: int, k: int, dtype: torch.dtype) -> GemvConfig:
    """The weight-only GEMV over fp8 rows: ~2 programs per SM (of 132) as the bf16 heuristic; a 1,024-wide K
    block moves as many bytes a stage as bf16's 512; fp32 activations use the FMA path (exact)."""
    split_k = max(1, min(8, (2 * 132 * 16) // max(n, 1)))
    if dtype == torch.float32:
        return GemvConfig(split_k=split_k, use_dot=False, block_k=max(16, 8192 // (16 * triton.next_power_of_2(m))))
    return GemvConfig(split_k=split_k, block_k=1024 if k % 1024 == 0 else 512)


def _check_shapes(k: int, weight: Fp8Weight, bias: torch.Tensor | None) -> None:
    if weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} must be [N, K={k}]")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [N={weight.shape[0]}]")


def _w8a8(xq: torch.Tensor, sx: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None,
          out_dtype: torch.dtype) -> torch.Tensor:
    m, k = xq.shape
    cfg = skinny_config(m, weight.shape[0], k, xq.device) if m <= SKINNY_MAX_ROWS else None
    if cfg is not None:
        return fp8_skinny_triton(xq, sx, weight, bias, out_dtype, cfg)
    return fp8_gemm_triton(xq, sx, weight, bias, out_dtype)


def linear_fp8_triton(x: torch.Tensor | Fp8Activation, weight: Fp8Weight,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    k = x.shape[-1]
    n = weight.shape[0]
    _check_shapes(k, weight, bias)
    if isinstance(x, Fp8Activation):
        if x.shape[0] == 0:
            return torch.empty((0, n), dtype=x.dtype, device=x.q.device)
        check_quantized_rows(x)
        return _w8a8(x.q, x.scale, weight, bias, x.dtype)
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*x.shape[:-1], n))
    if quantizes_activations(m):
        xq, sx = quantize_rows_fp8_triton(x2)
        out = _w8a8(xq, sx, weight, bias, x.dtype)
    else:
        out = gemv_triton(x2, weight.weight, bias, gemv_config(m, n, k, x.dtype), scale=weight.scale)
    return out.view(*x.shape[:-1], n)
