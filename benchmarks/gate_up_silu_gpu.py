"""Measured, not built into the engine: the MLP's gate_up projection with SiLU-and-mul in its epilogue (the
prototype kernel below) against the unfused pair the engine runs, at llama3-8b's shape (x [M, 4,096], W [28,672, 4,096]) and prefill row
counts, bf16 and fp8 linears:

    bf16   unfused: cuBLAS gate_up (torch's linear) -> silu_and_mul_triton          fused: gate_up_silu_triton
    fp8    unfused: fp8_gemm_triton -> silu_and_mul_fp8_triton (the down input's codes)
           fused:   gate_up_silu_triton -> quantize_rows_fp8_triton (the same codes' input, quantized apart)

    python benchmarks/gate_up_silu_gpu.py [--rows 512 1024 2048 4096 8192] [--rounds 3] [--reps 10] [--out F]

Each fused config is checked against the unfused output before it is timed. Timing: rounds of every variant
interleaved (each round: 2 untimed calls, then --reps back to back between two CUDA events), the median over
rounds per call, so clock drift lands on all variants alike; back to back, as a prefill runs its layers (the
card's power cap included). The bf16 GEMM alone is timed too (its TFLOP/s: how far the fused kernel's own GEMM
is from cuBLAS's). Writes JSON (default benchmarks/results/gate_up_silu_gpu.json).

Why it was tried (issue 23, prefill 4,096 <= 95 ms, missed back to back under the card's power cap): the unfused
MLP writes the [M, 2 I] gate_up product and silu_and_mul reads it back, at 4,096 rows 235 MB each way a layer,
3.8 ms of the prefill's kernels (H100 profile), and fewer DRAM bytes are fewer joules. The prototype:

    grid cdiv(M, BLOCK_M) * cdiv(I, BLOCK_N) in GROUP_M-row super-groups
    program (m, n):  acc_g = x[m-tile] . W[gate rows n-tile]^T,  acc_u = x[m-tile] . W[up rows I + n-tile]^T
                     (one x tile for both dots; fp8: times both scales), gate and up rounded to x's dtype as the
                     unfused product stores them, out[m-tile, n-tile] = silu(gate) * up

Result on an H100 (2026-12-06, results/gate_up_silu_h100.json, best of 8 bf16 / 7 fp8 configs per row count):
bf16 fused 0.78-0.81x the unfused pair's speed at 512-8,192 rows (4,096: 1.80 against 1.43 ms; Triton's two
dots reach ~570 TFLOP/s where cuBLAS's GEMM alone runs 745-760), fp8 0.93-0.97x (4,096: 0.94 against 0.90 ms).
The whole 4,096-token prefill, with this kernel dispatched from engine/model.py's MLP at every row count in a
working tree not kept (`prefill_4096_gpu.py --variants cudnn cudnn_fused fp8_cudnn fp8_cudnn_fused`, the
_fused variants switching it on; results/prefill_4096_fused_h100.json, 4 rounds x 5 interleaved): bf16 104.0 ->
110.5 ms median, fp8 linears 67.5 -> 72.4; profiled, the unfused prefill's kernels were GEMMs 74.8 ms, SiLU 3.8. The fusion would pay only with a GEMM within ~10 % of cuBLAS's.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from pdserve.kernels.activation_triton import silu_and_mul_fp8_triton, silu_and_mul_triton
from pdserve.kernels.fp8_activation import Fp8Activation
from pdserve.kernels.fp8_weight import Fp8Weight, quantize_weight_fp8
from pdserve.kernels.linear_fp8_triton import (  # Fp8GemmConfig: a GEMM's tile config, here for both dtypes
    Fp8GemmConfig,
    fp8_gemm_triton,
    grouped_tile,
    quantize_rows_fp8_triton,
)


@triton.jit(do_not_specialize=["M"])
def _gate_up_silu_kernel(
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, out_ptr, M, I, K, stride_am, stride_wn, stride_om,
    SCALED: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # a: [M, K]; w: [2 I, K] (gate | up rows); SCALED: a_scale [M], w_scale [2 I] (fp8); out: [M, I]
    # grid: (cdiv(M, BLOCK_M) * cdiv(I, BLOCK_N),)
    offs_m, offs_n, rm, rn = grouped_tile(M, I, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K], gate rows
    u_ptrs = w_ptr + (rn + I).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # the matching up rows
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = (offs_k + k0 < K)[None, :]
            a = tl.load(a_ptrs, mask=k_ok, other=0.0)
            g = tl.load(g_ptrs, mask=k_ok, other=0.0)
            u = tl.load(u_ptrs, mask=k_ok, other=0.0)
        acc_g = tl.dot(a, tl.trans(g), acc_g)
        acc_u = tl.dot(a, tl.trans(u), acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if SCALED:
        sa = tl.load(a_scale_ptr + rm)[:, None]
        acc_g *= sa * tl.load(w_scale_ptr + rn)[None, :]
        acc_u *= sa * tl.load(w_scale_ptr + I + rn)[None, :]
    gate = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)  # as the unfused gate_up product is stored
    up = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
    h = gate / (1.0 + tl.exp(-gate)) * up
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < I)[None, :])


def gate_up_silu_triton(x: torch.Tensor | Fp8Activation, weight: torch.Tensor | Fp8Weight,
                        cfg: Fp8GemmConfig) -> torch.Tensor:
    """silu_and_mul(linear(x, weight)) in one kernel: x [M, K] (a tensor, or an Fp8Activation for an Fp8Weight)
    and weight [2 I, K] -> [M, I] in x's dtype. A plain x with an Fp8Weight is quantized per row first."""
    if isinstance(weight, Fp8Weight):
        if not isinstance(x, Fp8Activation):
            from pdserve.kernels.linear_fp8_triton import quantize_rows_fp8_triton

            x = Fp8Activation(*quantize_rows_fp8_triton(x.reshape(-1, x.shape[-1])), x.dtype)
        a, a_scale, w, w_scale, out_dtype = x.q, x.scale, weight.weight, weight.scale, x.dtype
    elif isinstance(x, Fp8Activation):
        raise TypeError(f"an fp8-quantized input {tuple(x.shape)} needs an Fp8Weight, got a {weight.dtype} weight")
    else:
        a, a_scale, w, w_scale, out_dtype = x, None, weight, None, x.dtype
    m, k = a.shape
    n2 = w.shape[0]
    if w.shape[1] != k or n2 % 2 or a.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"x {tuple(a.shape)} and gate_up weight {tuple(w.shape)} must share K with unit stride, "
                         f"the weight's rows even (gate | up)")
    inter = n2 // 2
    out = torch.empty((m, inter), dtype=out_dtype, device=a.device)
    if m == 0 or inter == 0:
        return out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(inter, cfg.block_n),)
    scaled = a_scale is not None
    _gate_up_silu_kernel[grid](
        a, w, a_scale if scaled else out, w_scale if scaled else out, out, m, inter, k,
        a.stride(0), w.stride(0), out.stride(0), SCALED=scaled, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


K, INTER = 4096, 14336
BF16_CONFIGS = [Fp8GemmConfig(bm, bn, bk, 8, w, st) for bm, bn, bk, w, st in (
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 64, 64, 8, 4), (64, 128, 64, 4, 4),
    (256, 64, 64, 8, 3), (128, 64, 128, 8, 3), (128, 128, 32, 8, 5))]
FP8_CONFIGS = [Fp8GemmConfig(bm, bn, bk, 8, w, st) for bm, bn, bk, w, st in (
    (128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 64, 128, 4, 4), (128, 64, 128, 8, 4), (64, 128, 128, 4, 4),
    (256, 64, 128, 8, 3), (128, 64, 256, 8, 3))]


def name(cfg: Fp8GemmConfig) -> str:
    return f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} st{cfg.num_stages}"


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def codes(act: Fp8Activation) -> torch.Tensor:
    return act.dequantize()


def fused_fp8(xa: Fp8Activation, w8, cfg: Fp8GemmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """What the engine's fp8 MLP runs fused: the product, then its rows quantized for down."""
    return quantize_rows_fp8_triton(gate_up_silu_triton(xa, w8, cfg))


def timed(fns: dict, rounds: int, reps: int) -> dict[str, float]:
    """Median ms per call of each fn, rounds interleaved."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for key, fn in fns.items():
            fn()
            fn()
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            samples[key].append(start.elapsed_time(end) / reps)
    return {k: statistics.median(v) for k, v in samples.items()}


def one_row_count(m: int, w: torch.Tensor, w8, rounds: int, reps: int) -> dict:
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    xa = Fp8Activation(*quantize_rows_fp8_triton(x), torch.bfloat16)
    fns = {
        "bf16_gemm_only": lambda: torch.nn.functional.linear(x, w),
        "bf16_unfused": lambda: silu_and_mul_triton(torch.nn.functional.linear(x, w)),
        "fp8_unfused": lambda: silu_and_mul_fp8_triton(fp8_gemm_triton(xa.q, xa.scale, w8, None, torch.bfloat16)),
    }
    ref16 = fns["bf16_unfused"]()
    ref8 = codes(fns["fp8_unfused"]())
    errors = {}
    for cfg in BF16_CONFIGS:
        key = "bf16_fused " + name(cfg)
        try:
            errors[key] = rel(gate_up_silu_triton(x, w, cfg), ref16)
        except (OutOfResources, RuntimeError) as exc:  # a config this card cannot run (shared memory): named
            errors[key] = f"{type(exc).__name__}: {str(exc)[:120]}"
            continue
        fns[key] = functools.partial(gate_up_silu_triton, x, w, cfg)
    for cfg in FP8_CONFIGS:
        key = "fp8_fused " + name(cfg)
        try:
            errors[key] = rel(codes(Fp8Activation(*quantize_rows_fp8_triton(gate_up_silu_triton(xa, w8, cfg)),
                                                  torch.bfloat16)), ref8)
        except (OutOfResources, RuntimeError) as exc:
            errors[key] = f"{type(exc).__name__}: {str(exc)[:120]}"
            continue
        fns[key] = functools.partial(fused_fp8, xa, w8, cfg)
    bad = [k for k, e in errors.items() if isinstance(e, float) and e > 2e-2]
    for k in bad:
        fns.pop(k, None)
    ms = timed(fns, rounds, reps)
    row: dict = {"rows": m, "ms": {k: round(v, 4) for k, v in ms.items()}, "rel_error": errors, "wrong": bad}
    for kind in ("bf16", "fp8"):
        fused = {k: v for k, v in ms.items() if k.startswith(kind + "_fused")}
        if fused:
            best = min(fused, key=fused.get)
            row[f"{kind}_best"] = best.removeprefix(kind + "_fused ")
            row[f"{kind}_fused_ms"] = round(fused[best], 4)
            row[f"{kind}_speedup"] = round(ms[kind + "_unfused"] / fused[best], 3)
    row["bf16_gemm_tflops"] = round(2 * m * K * 2 * INTER / ms["bf16_gemm_only"] / 1e9, 1)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/gate_up_silu_gpu.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    w = torch.randn(2 * INTER, K, device="cuda", dtype=torch.bfloat16) * 0.02
    w8 = quantize_weight_fp8(w)
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "shape": {"K": K, "I": INTER},
              "configs": {"bf16": [asdict(c) for c in BF16_CONFIGS], "fp8": [asdict(c) for c in FP8_CONFIGS]},
              "rows": []}
    for m in args.rows:
        row = one_row_count(m, w, w8, args.rounds, args.reps)
        result["rows"].append(row)
        print(f"M {m:5d}  bf16 unfused {row['ms']['bf16_unfused']:.3f} ms (gemm {row['ms']['bf16_gemm_only']:.3f},"
              f" {row['bf16_gemm_tflops']} TFLOP/s)  fused {row.get('bf16_fused_ms')} [{row.get('bf16_best')}]"
              f" x{row.get('bf16_speedup')} | fp8 unfused {row['ms']['fp8_unfused']:.3f} fused"
              f" {row.get('fp8_fused_ms')} [{row.get('fp8_best')}] x{row.get('fp8_speedup')}"
              f"{'  WRONG ' + str(row['wrong']) if row['wrong'] else ''}", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
