"""Would the Triton GEMV (kernels/linear_triton.py, tl.dot with the batch as BLOCK_M) beat cuBLAS at 32 and 64
rows, where the dispatcher hands bf16 decode batches to torch.matmul (MAX_TRITON_BATCH = 16)? Measured before
building: the kernel already takes any power-of-two BLOCK_M; only its launcher's row limit is lifted here.

    python benchmarks/gemv_wide_rows_gpu.py --out benchmarks/results/gemv_wide_rows_h200.json   (GPU)

Per llama3-8b layer shape (and lm_head) and rows: every config of a small grid graph-timed on rotated weights
(benchmarks/kernels_common.graph_us), checked against F.linear first, beside F.linear's own time; a layer's four
products summed at each row count tell what a decode step of that batch would gain.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from kernels_common import copies_for, graph_us, rel_error, rotating

from pdserve.kernels import linear_triton
from pdserve.kernels.linear_triton import GemvConfig, gemv_triton

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
CONFIGS = [GemvConfig(block_n=bn, block_k=bk, split_k=s, num_warps=w, num_stages=st)
           for bn in (64, 128) for bk in (64, 128) for s in (1, 2, 4) for w in (4, 8) for st in (3, 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gemv_wide_rows_h200.json"))
    args = parser.parse_args()
    linear_triton.MAX_TRITON_BATCH = max(args.rows)  # the experiment: the launcher's limit lifted, nothing else
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: dict[str, dict] = {}
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
                   for _ in range(copies_for(2 * n * k))]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            ref = F.linear(x, weights[0])
            configs: dict[str, float | str] = {}
            for cfg in CONFIGS:
                key = f"n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"
                try:
                    if rel_error(gemv_triton(x, weights[0], None, cfg), ref) > 1e-2:
                        configs[key] = "wrong"
                        continue
                    configs[key] = graph_us(rotating([lambda w=w, c=cfg, x=x: gemv_triton(x, w, None, c) for w in weights]))
                except Exception as exc:  # noqa: BLE001 -- e.g. out of shared memory: recorded, not fatal
                    configs[key] = f"{type(exc).__name__}: {str(exc)[:80]}"
            timed = sorted((us, key) for key, us in configs.items() if isinstance(us, float) and not math.isnan(us))
            torch_us = graph_us(rotating([lambda w=w, x=x: F.linear(x, w) for w in weights]))
            best_us, best = timed[0] if timed else (math.nan, None)
            rows[f"{name}_m{m}"] = {"torch_us": torch_us, "best_us": best_us, "best": best, "configs_us": configs,
                                    "torch_over_best": torch_us / best_us, "best_gbps": 2 * n * k / (best_us * 1e3)}
            print(f"{name:8s} m={m:3d} torch {torch_us:7.1f} us  triton best {best_us:7.1f} us ({best}; "
                  f"{2 * n * k / (best_us * 1e3):.0f} GB/s)  torch/triton {torch_us / best_us:.3f}", flush=True)
        del weights
        torch.cuda.empty_cache()
    layer = {m: sum(rows[f"{s}_m{m}"]["torch_us"] for s in ("qkv", "o", "gate_up", "down"))
             / sum(rows[f"{s}_m{m}"]["best_us"] for s in ("qkv", "o", "gate_up", "down")) for m in args.rows}
    print("a layer's four products, torch / best triton:", {m: round(v, 3) for m, v in layer.items()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(),
                                    "torch": torch.__version__, "rows": rows, "layer_torch_over_triton": layer},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
