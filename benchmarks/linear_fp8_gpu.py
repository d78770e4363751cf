"""fp8 linears against bf16 at llama3-8b's four layer shapes: our dispatcher on each (bf16: the tuned GEMV or
cuBLAS; fp8: quantize + W8A8 GEMM, see kernels/fp8_weight.py), the weight-only GEMV, torch._scaled_mm on the same
fp8 operands, and a small sweep of the GEMM's tile configs and the GEMV's K block, so the defaults can be set
from numbers.

    python benchmarks/linear_fp8_gpu.py --out benchmarks/results/linear_fp8_h200.json   (H200)

Times: median of CUDA-event timings over 4 rotated weight copies (a 4096 x 4096 fp8 weight, 16 MB, would
otherwise sit in the 60 MB L2). GB/s counts the weight bytes only.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.kernels import linear
from pdserve.kernels.fp8_weight import quantize_weight_fp8
from pdserve.kernels.linear_fp8_triton import (
    Fp8GemmConfig,
    fp8_gemm_triton,
    gemv_config,
    quantize_rows_fp8_triton,
)
from pdserve.kernels.linear_triton import gemv_triton

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 8, 64, 4096)
GEMM_SWEEP = (Fp8GemmConfig(64, 64, 128, 8, 4, 5), Fp8GemmConfig(64, 128, 128, 8, 4, 4),
              Fp8GemmConfig(64, 32, 256, 8, 4, 4), Fp8GemmConfig(128, 128, 128, 8, 8, 4),
              Fp8GemmConfig(128, 256, 128, 8, 8, 3), Fp8GemmConfig(128, 128, 64, 8, 4, 5))


def time_us(fn: Callable[[int], object], repeat: int = 30) -> float:
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def shape_rows(n: int, k: int, m: int) -> dict[str, object]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5 for _ in range(4)]
    qs = [quantize_weight_fp8(w) for w in ws]
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    row: dict[str, object] = {"bf16_us": time_us(lambda i: linear(x, ws[i % 4])),
                              "fp8_us": time_us(lambda i: linear(x, qs[i % 4]))}
    if m > 16:
        xq, sx = quantize_rows_fp8_triton(x)
        row["quantize_us"] = time_us(lambda i: quantize_rows_fp8_triton(x))
        row["scaled_mm_us"] = time_us(lambda i: torch._scaled_mm(
            xq, qs[i % 4].weight.T, scale_a=sx[:, None], scale_b=qs[i % 4].scale[None, :], out_dtype=torch.bfloat16))
        row["gemm_sweep_us"] = {f"{c.block_m}x{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}": time_us(
            lambda i, c=c: fp8_gemm_triton(xq, sx, qs[i % 4], None, torch.bfloat16, c)) for c in GEMM_SWEEP}
    else:
        base = gemv_config(m, n, k, torch.bfloat16)
        row["gemv_sweep_us"] = {}
        for block_k in (256, 512, 1024):
            for split_k in sorted({1, base.split_k, 2 * base.split_k}):
                cfg = type(base)(block_n=16, block_k=block_k, split_k=split_k, num_warps=4, num_stages=4)
                row["gemv_sweep_us"][f"bk{block_k}sk{split_k}"] = time_us(  # type: ignore[index]
                    lambda i, cfg=cfg: gemv_triton(x, qs[i % 4].weight, None, cfg, scale=qs[i % 4].scale))
    row["fp8_weight_gbps"] = n * k / (float(row["fp8_us"]) * 1e3)  # type: ignore[arg-type]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/linear_fp8_h200.json"))
    args = parser.parse_args()
    result: dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                 "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    for name, (n, k) in SHAPES.items():
        for m in ROWS:
            row = shape_rows(n, k, m)
            result["rows"][f"{name}_{n}x{k}_m{m}"] = row  # type: ignore[index]
            print(f"{name:8s} m={m:5d} bf16 {row['bf16_us']:8.1f} us  fp8 {row['fp8_us']:8.1f} us  "
                  f"scaled_mm {row.get('scaled_mm_us', float('nan')):8.1f} us", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
