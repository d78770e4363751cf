"""Our W8A8 product (kernels/linear_fp8_triton.py's dispatch: the skinny kernel or the GEMM, by its config table)
against cuBLASLt / CUTLASS through torch._scaled_mm (row-wise scales) on the same fp8 operands, at llama3-8b's
four layer shapes, from decode batches (1-64 rows) to a 4,096-token prefill; bf16's dispatcher beside them.

    python benchmarks/fp8_scaled_mm_gpu.py --out benchmarks/results/fp8_scaled_mm_graph_h200.json   (H200)

x arrives quantized (an Fp8Activation, as the fused norm / SiLU kernels hand it to three of a layer's four
linears), so neither side pays for the quantization. Times: median per call over CUDA-graph replays of
back-to-back calls on rotated weight copies (the working set >= 4x the L2), as a decode step's graph runs them
(benchmarks/kernels_common.graph_us). Each product is checked against the fp32 reference first.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from kernels_common import copies_for, graph_us, rotating

from pdserve.kernels import linear
from pdserve.kernels.fp8_activation import Fp8Activation
from pdserve.kernels.fp8_weight import quantize_weight_fp8
from pdserve.kernels.linear_fp8 import linear_fp8_ref
from pdserve.kernels.linear_fp8_triton import quantize_rows_fp8_triton

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 8, 16, 32, 64, 128, 512, 4096)


def scaled_mm(x: Fp8Activation, w) -> torch.Tensor:
    return torch._scaled_mm(x.q, w.weight.t(), scale_a=x.scale[:, None], scale_b=w.scale[None, :],
                            out_dtype=x.dtype)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def compare(n: int, k: int, m: int, fp8: list, bf16: list, gen: torch.Generator) -> dict[str, float | str]:
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    act = Fp8Activation(*quantize_rows_fp8_triton(x), torch.bfloat16)
    ref = linear_fp8_ref(act, fp8[0])
    row: dict[str, float | str] = {"ours_err": rel(linear(act, fp8[0]), ref)}
    row["ours_us"] = graph_us(rotating([lambda w=w: linear(act, w) for w in fp8]))
    try:
        row["scaled_mm_err"] = rel(scaled_mm(act, fp8[0]), ref)
        row["scaled_mm_us"] = graph_us(rotating([lambda w=w: scaled_mm(act, w) for w in fp8]))
    except RuntimeError as exc:  # e.g. a row count the library refuses: recorded, not fatal
        row["scaled_mm_us"], row["scaled_mm_error"] = math.nan, str(exc)[:160]
    row["bf16_us"] = graph_us(rotating([lambda w=w: linear(x, w) for w in bf16]))
    row["scaled_mm_speedup"] = row["ours_us"] / row["scaled_mm_us"]
    row["ours_fp8_gbps"], row["scaled_mm_fp8_gbps"] = (n * k / (row[key] * 1e3) for key in ("ours_us", "scaled_mm_us"))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fp8_scaled_mm_graph_h200.json"))
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: dict[str, dict] = {}
    for name, (n, k) in SHAPES.items():
        fp8 = [quantize_weight_fp8(torch.randn(n, k, device="cuda", generator=gen) / k**0.5)
               for _ in range(copies_for(n * k))]
        bf16 = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
                for _ in range(copies_for(2 * n * k))]
        for m in args.rows:
            rows[f"{name}_m{m}"] = row = compare(n, k, m, fp8, bf16, gen)
            print(f"{name:8s} m={m:5d} ours {row['ours_us']:8.1f} us ({row['ours_fp8_gbps']:5.0f} GB/s)  scaled_mm "
                  f"{row['scaled_mm_us']:8.1f} us ({row['scaled_mm_fp8_gbps']:5.0f} GB/s, "
                  f"{row['scaled_mm_speedup']:.2f}x)  bf16 {row['bf16_us']:8.1f} us", flush=True)
        del fp8, bf16
        torch.cuda.empty_cache()
    per_m = {m: sum(rows[f"{s}_m{m}"]["ours_us"] for s in SHAPES) / sum(rows[f"{s}_m{m}"]["scaled_mm_us"]
                                                                      for s in SHAPES) for m in args.rows}
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": rows, "layer_ours_over_scaled_mm_by_rows": per_m}
    print("a layer's four products, ours / scaled_mm:", {m: round(v, 3) for m, v in per_m.items()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
