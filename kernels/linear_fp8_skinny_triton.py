"""The W8A8 product for decode-sized batches (M <= SKINNY_MAX_ROWS): fp8 tensor-core dots with the operands
swapped, split along K.

    xq, sx = quantize_rows_fp8_triton(x)          (kernels/linear_fp8_triton.py: e4m3 codes, one scale a row)
    grid (cdiv(N, BLOCK_N), SPLIT_K): program (n, s) over its K range
      acc[BLOCK_N, BLOCK_M] += W[n-tile, k-tile] (e4m3) . xq[:, k-tile]^T (e4m3)
      acc * s[n] * sx[m] -> y[m, n] (SPLIT_K == 1, + bias) or fp32 partials [SPLIT_K, M, N] (summed, + bias, by
      linear_triton's split-K reduce kernel)

Why swapped: at M = 1-64 the product is a pass over W (1 byte a weight). With W as the dot's M side, a program
streams a [BLOCK_N, BLOCK_K] tile of W per step and the batch (padded to BLOCK_M = 16, 32 or 64) is the dot's
narrow side, so no tensor-core work is spent on 64 padded batch rows and no fp8 -> bf16 conversion of W is
needed (the weight-only GEMV upcast W in registers and read it at ~1 TB/s on the H200). Split-K gives the
parallelism that N alone lacks (N = 4,096 is 64 tiles of 64 for 132 SMs).

Numerics are those of kernels/linear_fp8_triton.py's GEMM at any M: the same quantized x, fp32 accumulation;
only the order of the fp32 sums differs. Quantizing x inside the kernel instead (each program taking the row's
amax over the whole K before its first W load) was slower at every shape and batch measured on the H200
(benchmarks/results/linear_fp8_skinny_h200.json, 2026-12-02: the amax pass delays the W stream), so x is
quantized by its own kernel first.

H200, CUDA-graph replay, rotated weights, quantization included, best config per shape (same run): at 1 row qkv
13.2 us (1.9 TB/s of fp8 weight), o 10.9 (1.5), gate_up 33.0 (3.6), down 23.6 (2.5), against bf16's 15.2, 11.4,
61.7, 30.2 and the W8A8 GEMM's 43.4, 30.4, 70.7, 77.4; at 64 rows 15.2, 13.0, 36.5, 28.3 (GEMM 13.2, 10.9, 36.6,
29.0). The small shapes stay far from the bandwidth: ~8 us of each is the three launches' fixed cost.
That H200 sweep timed x pre-quantized in three configs only (all split >= 2; the rest quantized inside the
kernel). The H100's sweep (2026-12-06, results/linear_fp8_skinny_h100.json, every config pre-quantized) found
split-1 tiles best almost everywhere: at 64 rows qkv 12.8 us, o 10.4, gate_up 47.1, down 27.5, where the H200's
picks run 4-35 % slower on the H100. The same sweep on the H200 (2026-12-06, results/linear_fp8_skinny_tables_h200.json,
the entries shipped): at 1 row qkv 9.3 us (2.7 TB/s), o 8.0 (2.1), gate_up 31.1 (3.8), down 18.6 (3.2, split 2);
at 64 rows 10.6, 9.4, 34.8, 22.2; decode b1 ctx 512 with fp8 linears 3.20 -> 2.98 ms, b64 5.17 -> 4.86.

What is compiled: per weight shape class (EVEN, the scale/bias flags) one kernel per BLOCK_M bucket (16, 32, 64)
and config; M and the partials' stride are do_not_specialize, so every batch of a bucket shares one kernel. The
decode graphs capture every bucket; the prefill warm-up's powers of two reach 16, 32 and 64 rows.
"""

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8_weight import Fp8Weight
from pdserve.kernels.linear_triton import reduce_split_k, split_k_layout
from pdserve.kernels.pdl import launch_options, prefetch_l2, weight_prefetch_bytes
from pdserve.kernels.tuning import TuningTable, device_name

SKINNY_MAX_ROWS = 64


@dataclass(frozen=True)
class Fp8SkinnyConfig:
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit(do_not_specialize=["M", "stride_ps"])
def _fp8_skinny_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om, stride_ps,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
):
    # x: [M, K] e4m3, x_scale: [M]; w: [N, K] e4m3, w_scale: [N]; out: [M, N]; grid: (cdiv(N, BLOCK_N), SPLIT_K)
    # PREFETCH: bytes of each of the program's W rows fetched into L2 before the PDL wait (kernels/pdl.py)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)  # columns past N read row N mod N
    if PREFETCH > 0:
        prefetch_l2(w_ptr + rn.to(tl.int64) * stride_wn + pid_k * k_per_split,
                    tl.minimum(PREFETCH, K - pid_k * k_per_split))
    if PDL:  # kernels/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    sx = tl.load(x_scale_ptr + offs_m, mask=m_ok, other=1.0)
    offs_k = pid_k * k_per_split + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        if EVEN:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (offs_k + k0 < K)[None, :]
            w = tl.load(w_ptrs, mask=k_ok, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok, other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    acc *= tl.load(w_scale_ptr + rn)[:, None] * sx[None, :]  # per row and column: commutes with the split sum
    mask = (offs_n < N)[:, None] & m_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k * stride_ps + offs_m[None, :] * N + offs_n[:, None], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


def block_m_for(m: int) -> int:
    """The batch tile: 16 (the dot's narrowest), 32 or 64 rows."""
    if not 0 < m <= SKINNY_MAX_ROWS:
        raise ValueError(f"the skinny fp8 kernel takes 1..{SKINNY_MAX_ROWS} rows, got {m}")
    return max(16, triton.next_power_of_2(m))


def fp8_skinny_triton(xq: torch.Tensor, x_scale: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None,
                      out_dtype: torch.dtype, cfg: Fp8SkinnyConfig) -> torch.Tensor:
    """xq [M, K] e4m3 (unit stride along K) with x_scale [M] fp32 -> [M, N] in out_dtype."""
    m, k = xq.shape
    n = weight.shape[0]
    if weight.shape[1] != k or xq.stride(1) != 1 or weight.weight.stride(1) != 1:
        raise ValueError(f"x {tuple(xq.shape)} and weight {tuple(weight.shape)} must share K with unit stride")
    block_m = block_m_for(m)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    k_per_split, split_k = split_k_layout(k, cfg.split_k, cfg.block_k)
    even = k_per_split * split_k == k
    part = torch.empty((split_k, m, n), dtype=torch.float32, device=xq.device) if split_k > 1 else out
    bias_arg = bias if bias is not None else out
    _fp8_skinny_kernel[(triton.cdiv(n, cfg.block_n), split_k)](
        xq, x_scale, weight.weight, weight.scale, bias_arg, out, part,
        m, n, k, k_per_split, xq.stride(0), weight.weight.stride(0), out.stride(0), part.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split_k > 1, EVEN=even, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch_options(xq.device),
        PREFETCH=weight_prefetch_bytes("fp8_skinny", xq.device, weight.weight, k, k_per_split,
                                       cfg.block_k * cfg.num_stages),
    )
    if split_k > 1:
        reduce_split_k(part, bias, out)
    return out


CONFIGS_PATH = Path(__file__).with_name("linear_fp8_configs.json")


ROW_BUCKETS = (1, 8, 16, 32, 64)  # configs are tuned at these batches; a batch takes the next bucket's


def config_key(device_name: str, n: int, k: int, m: int) -> str:
    """linear_fp8_configs.json's key: device, weight shape and row bucket."""
    block_m_for(m)  # checks the range
    return f"{device_name}|{n}|{k}|{next(b for b in ROW_BUCKETS if m <= b)}"


@functools.cache
def configs_table() -> TuningTable:
    """The configs measured by benchmarks/linear_fp8_skinny_gpu.py on each device (read once; empty if absent)."""
    return TuningTable.load(CONFIGS_PATH)


@functools.lru_cache(maxsize=1024)  # the launch path runs per layer per step: look each shape up once
def skinny_config(m: int, n: int, k: int, device: torch.device) -> Fp8SkinnyConfig | None:
    """The measured config for this device, shape and row bucket, or None where the W8A8 GEMM measured faster
    (then it runs). Without an entry (a device no sweep has run on), what the H100's sweep picked at llama3-8b's
    shapes (results/linear_fp8_skinny_h100.json): no split, 256-deep K blocks, 64 rows of W a program in 5 stages,
    128 in 3 for N >= 16,384 (gate_up). Over the sweep's 20 shape x batch cells these sum to 459.9 us against
    459.2 for the best of each cell, where the earlier heuristic (split along K until ~4 programs a SM) summed to
    525-536 us (its 4 stages were not swept: 3 and 5). In the engine on an H100 with the table set aside
    (`engine_gpu.py --quantization fp8,fp8-heuristic,fp8-splitk`, results/engine_gpu_skinny_fallback_h100.json),
    decode b64 ctx 512: table 5.90 ms, this fallback 5.92, the split-K one 6.95; b1 3.72, 3.72, 3.95."""
    entry = configs_table().entries.get(config_key(device_name(device), n, k, m))
    if entry is not None:
        return Fp8SkinnyConfig(**entry["config"]) if entry["backend"] == "triton" else None
    if n >= 16384:
        return Fp8SkinnyConfig(block_n=128, block_k=256, split_k=1, num_stages=3)
    return Fp8SkinnyConfig(block_n=64, block_k=256, split_k=1, num_stages=5)
