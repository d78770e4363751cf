"""The decode-batch fp8 linear (kernels/linear_fp8_skinny_triton.py) tuned and timed at llama3-8b's four layer
shapes, against the bf16 dispatcher and the W8A8 GEMM path it replaced, and written as the device's config table.

    python benchmarks/linear_fp8_skinny_gpu.py --out benchmarks/results/linear_fp8_skinny_h200.json \
        --table kernels/linear_fp8_configs.json                                                  (H200)

Per shape and batch (1, 8, 16, 32, 64 rows): every tile config x split count, x quantized by its kernel first
(timed with it), each checked against linear_fp8_ref before it is timed.
Times: median per call over CUDA-graph replays of back-to-back calls on rotated weight copies (the working set
>= 4x the 60 MB L2), the way a decode step's graph runs them; GB/s counts the weight bytes. The table keeps the
fastest config per (shape, row bucket of linear_fp8_skinny_triton.ROW_BUCKETS), and names the GEMM where the
GEMM was faster than it.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from kernels_common import copies_for, graph_us, rotating

from pdserve.kernels import linear
from pdserve.kernels.fp8_weight import quantize_weight_fp8
from pdserve.kernels.linear_fp8 import linear_fp8_ref
from pdserve.kernels.linear_fp8_skinny_triton import (
    ROW_BUCKETS,
    Fp8SkinnyConfig,
    config_key,
    fp8_skinny_triton,
)
from pdserve.kernels.linear_fp8_triton import fp8_gemm_triton, quantize_rows_fp8_triton
from pdserve.kernels.tuning import TuningTable, device_name

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TILES = [Fp8SkinnyConfig(block_n=bn, block_k=bk, num_stages=st) for bn in (64, 128) for bk in (128, 256)
         for st in (3, 5)] + [Fp8SkinnyConfig(block_n=32, block_k=256, num_stages=4),
                              Fp8SkinnyConfig(block_n=64, block_k=512, num_stages=3),
                              Fp8SkinnyConfig(block_n=128, block_k=128, num_stages=4, num_warps=8)]
SPLITS = (1, 2, 4, 8, 16)


def name(cfg: Fp8SkinnyConfig) -> str:
    return f"n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"


def close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return float((out.float() - ref.float()).norm() / ref.float().norm()) < 2e-2


def skinny(x: torch.Tensor, w, cfg: Fp8SkinnyConfig) -> torch.Tensor:
    """What linear_fp8_triton runs at these rows: quantize x, then the skinny product."""
    return fp8_skinny_triton(*quantize_rows_fp8_triton(x), w, None, x.dtype, cfg)


def sweep(n: int, k: int, m: int, weights: list, x: torch.Tensor) -> dict:
    ref = linear_fp8_ref(x, weights[0])
    configs: dict = {}
    by_name = {}
    for tile in TILES:
        for split in SPLITS:
            if k // split < tile.block_k:
                continue
            cfg = replace(tile, split_k=split)
            by_name[name(cfg)] = cfg
            try:
                if not close(skinny(x, weights[0], cfg), ref):
                    configs[name(cfg)] = "wrong"
                    continue
                configs[name(cfg)] = graph_us(rotating([lambda w=w, cfg=cfg: skinny(x, w, cfg) for w in weights]))
            except Exception as exc:  # noqa: BLE001 -- e.g. out of shared memory: recorded, not fatal
                configs[name(cfg)] = f"{type(exc).__name__}: {str(exc)[:80]}"
    timed = sorted((us, key) for key, us in configs.items() if isinstance(us, float))
    row: dict = {"configs_us": configs}
    row["best"], row["best_us"] = (timed[0][1], timed[0][0]) if timed else (None, float("nan"))
    row["best_config"] = asdict(by_name[row["best"]]) if row["best"] else None
    row["w8a8_gemm_us"] = graph_us(rotating([lambda w=w: fp8_gemm_triton(*quantize_rows_fp8_triton(x), w, None, x.dtype)
                                             for w in weights]))
    row["fp8_weight_gbps"] = n * k / (row["best_us"] * 1e3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/linear_fp8_skinny_h200.json"))
    parser.add_argument("--table", type=Path, help="write the winners into this config table (merged)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROW_BUCKETS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = parser.parse_args()
    dev = device_name(torch.device("cuda"))
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": dev, "torch": torch.__version__,
                    "rows": {}}
    table = TuningTable.load(args.table) if args.table else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        n, k = SHAPES[shape]
        bf16 = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
                for _ in range(copies_for(n * k * 2))]
        fp8 = [quantize_weight_fp8(torch.randn(n, k, device="cuda", generator=gen) / k**0.5)
               for _ in range(copies_for(n * k))]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            row = sweep(n, k, m, fp8, x)
            row["bf16_us"] = graph_us(rotating([lambda w=w, x=x: linear(x, w) for w in bf16]))
            row["bf16_weight_gbps"] = 2 * n * k / (row["bf16_us"] * 1e3)
            result["rows"][f"{shape}_{n}x{k}_m{m}"] = row
            print(f"{shape:8s} m={m:3d} bf16 {row['bf16_us']:7.1f} us  w8a8 gemm {row['w8a8_gemm_us']:7.1f} us  "
                  f"skinny {row['best_us']:7.1f} us ({row['fp8_weight_gbps']:.0f} GB/s) {row['best']}", flush=True)
            if table is not None and row["best_config"] is not None and m in ROW_BUCKETS:
                skinny_wins = row["best_us"] <= row["w8a8_gemm_us"]
                table.entries[config_key(dev, n, k, m)] = {"backend": "triton" if skinny_wins else "gemm",
                                                          "config": row["best_config"],
                                                          "triton_us": round(row["best_us"], 2),
                                                          "gemm_us": round(row["w8a8_gemm_us"], 2)}
                table.save(args.table)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")  # after every row: a timeout keeps the rest
        del bf16, fp8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
