"""Our W8A8 GEMM (fp8_gemm_triton) against cuBLASLt's (torch._scaled_mm, row-wise scales) on the same fp8
operands, at llama3-8b's four layer shapes from 128 to 4,096 rows (kernels/linear_fp8_triton.py's gemm_config
says what came of it).

    python benchmarks/fp8_scaled_mm_gpu.py --out benchmarks/results/fp8_scaled_mm_h200.json   (H200)

Times as benchmarks/linear_fp8_gpu.py's (median of CUDA-event timings over 4 rotated weight copies).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from linear_fp8_gpu import SHAPES, time_us

from pdserve.kernels.fp8_weight import quantize_weight_fp8
from pdserve.kernels.linear_fp8_triton import fp8_gemm_triton, quantize_rows_fp8_triton

ROWS = (128, 256, 512, 1024, 2048, 4096)


def compare(n: int, k: int, m: int) -> dict[str, float]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    qs = [quantize_weight_fp8(torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5)
          for _ in range(4)]
    xq, sx = quantize_rows_fp8_triton(torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16))
    ours = time_us(lambda i: fp8_gemm_triton(xq, sx, qs[i % 4], None, torch.bfloat16))
    theirs = time_us(lambda i: torch._scaled_mm(xq, qs[i % 4].weight.t(), scale_a=sx[:, None],
                                                scale_b=qs[i % 4].scale[None, :], out_dtype=torch.bfloat16))
    return {"triton_us": ours, "scaled_mm_us": theirs, "scaled_mm_speedup": ours / theirs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fp8_scaled_mm_h200.json"))
    args = parser.parse_args()
    rows: dict[str, dict[str, float]] = {}
    for m in ROWS:
        for name, (n, k) in SHAPES.items():
            rows[f"{name}_m{m}"] = row = compare(n, k, m)
            print(f"{name:8s} m={m:5d} triton {row['triton_us']:8.1f} us  scaled_mm {row['scaled_mm_us']:8.1f} us"
                  f"  ({row['scaled_mm_speedup']:.2f}x)", flush=True)
    per_m = {m: sum(rows[f"{s}_m{m}"]["triton_us"] for s in SHAPES) / sum(rows[f"{s}_m{m}"]["scaled_mm_us"]
                                                                         for s in SHAPES) for m in ROWS}
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": rows,
              "layer_speedup_by_rows": per_m}
    print("a layer's four GEMMs, triton / scaled_mm:", {m: round(v, 3) for m, v in per_m.items()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
