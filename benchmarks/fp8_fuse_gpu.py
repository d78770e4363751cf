"""The fused fp8 producers against the pair they replace, per kernel, at llama3-8b's shapes on the GPU.

    python benchmarks/fp8_fuse_gpu.py --out benchmarks/results/fp8_fuse_kernels_h200.json   (fp8_fuse_h200.sh)
    TRITON_INTERPRET=1 python benchmarks/fp8_fuse_gpu.py --dry-run --out /tmp/fp8_fuse.json   (CPU plumbing)

For each of fused_add_rms_norm (hidden 4,096) and silu_and_mul (I = 14,336) at 1, 8, 64 and 4,096 rows, bf16:
    unfused: the producer's bf16 output, then quantize_rows_fp8_triton (what each fp8 linear ran before)
    fused:   the producer's _fp8 form (kernels/fp8_activation.py)
Times are medians of CUDA-graph replays of back-to-back calls (graph_us: what a decode graph pays, launches
included) and of do_bench with L2 flushed (prefill-sized rows). `same_codes` checks that both give the same
codes and scales bit for bit, before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_common
from kernels_common import SETTINGS, bench_us, graph_us

from pdserve.kernels.activation_triton import silu_and_mul_fp8_triton, silu_and_mul_triton
from pdserve.kernels.fp8_activation import Fp8Activation
from pdserve.kernels.linear_fp8_triton import quantize_rows_fp8_triton
from pdserve.kernels.rms_norm_triton import fused_add_rms_norm_fp8_triton, fused_add_rms_norm_triton

ROWS = (1, 8, 64, 4096)
HIDDEN, INTER = 4096, 14336


def same(a: Fp8Activation, q: torch.Tensor, s: torch.Tensor) -> bool:
    return torch.equal(a.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(a.scale, s)


def cases(m: int) -> dict[str, tuple[Callable[[], object], Callable[[], object], bool]]:
    """name -> (unfused, fused, same codes)."""
    dev, dtype = kernels_common.DEVICE, SETTINGS.dtype
    gen = torch.Generator(device=dev).manual_seed(0)
    x, r = (torch.randn(m, HIDDEN, device=dev, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(HIDDEN, device=dev, generator=gen).to(dtype)
    g = torch.randn(m, 2 * INTER, device=dev, generator=gen).to(dtype)

    def norm_unfused() -> tuple:
        out, h = fused_add_rms_norm_triton(x, r, w, 1e-5)
        return quantize_rows_fp8_triton(out), h

    def silu_unfused() -> tuple:
        return quantize_rows_fp8_triton(silu_and_mul_triton(g))

    (nq, ns), _ = norm_unfused()
    sq, ss = silu_unfused()
    return {
        "fused_add_rms_norm": (norm_unfused, lambda: fused_add_rms_norm_fp8_triton(x, r, w, 1e-5),
                               same(fused_add_rms_norm_fp8_triton(x, r, w, 1e-5)[0], nq, ns)),
        "silu_and_mul": (silu_unfused, lambda: silu_and_mul_fp8_triton(g), same(silu_and_mul_fp8_triton(g), sq, ss)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fp8_fuse_kernels_h200.json"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, fp16, 1 and 8 rows, times all 1 us")
    args = parser.parse_args()
    if args.dry_run:
        kernels_common.DEVICE, SETTINGS.dry_run, SETTINGS.dtype = "cpu", True, torch.float16
    rows = []
    for m in ROWS[:2] if args.dry_run else ROWS:
        for name, (unfused, fused, same_codes) in cases(m).items():
            row = {"kernel": name, "rows": m, "same_codes": same_codes,
                   "unfused_graph_us": graph_us(unfused), "fused_graph_us": graph_us(fused),
                   "unfused_us": bench_us(unfused), "fused_us": bench_us(fused)}
            rows.append(row)
            print(" ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows,
              "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
