"""The cuda_ipc transfer's copy kernel under other tile sizes: a 4,096-token llama3-8b KV (32 layers x 256
blocks, 512 MiB) copied block by block from one pool into another, one CUDA graph of the 32 per-layer launches
per config, beside torch's copy of the same bytes as one tensor and as 32 per-layer tensors.

    python benchmarks/engine_gpu_copy_sweep.py --out benchmarks/results/engine_gpu_copy_sweep_h200.json   (H200)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_gpu_profile import graph_ms

from pdserve.engine.presets import get_preset
from pdserve.kernels.block_copy_triton import copy_blocks_triton

BLOCKS, BLOCK_SIZE = 256, 16
CONFIGS = [(block, warps) for block in (1024, 2048, 4096, 8192, 16384) for warps in (2, 4, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_gpu_copy_sweep_h200.json"))
    args = parser.parse_args()
    c = get_preset("llama3-8b")
    shape = (2, 2 * BLOCKS, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    src = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(c.num_layers)]
    dst = [torch.zeros_like(p) for p in src]
    # scattered ids, as a pool hands them out: source blocks in reverse order, destinations interleaved
    src_ids = torch.arange(2 * BLOCKS - 1, BLOCKS - 1, -1, device="cuda")
    dst_ids = torch.arange(0, 2 * BLOCKS, 2, device="cuda")
    nbytes = c.num_layers * 2 * BLOCKS * BLOCK_SIZE * c.kv_size * 2
    rows = {}
    for block, warps in CONFIGS:
        ms = graph_ms(lambda b=block, w=warps: [copy_blocks_triton(s, src_ids, d, dst_ids, b, w)
                                                for s, d in zip(src, dst)])
        rows[f"triton block {block} warps {warps}"] = ms
    assert torch.equal(dst[5][:, dst_ids], src[5][:, src_ids]), "copy_blocks wrote the wrong blocks"
    flat_src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    rows["torch copy_, one 512 MiB tensor"] = graph_ms(lambda: flat_dst.copy_(flat_src))
    per_layer = [(s[:, :BLOCKS], d[:, BLOCKS:]) for s, d in zip(src, dst)]
    rows["torch copy_, 32 per-layer 16 MiB slices"] = graph_ms(lambda: [d.copy_(s) for s, d in per_layer])
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(), "bytes": nbytes,
              "rows": {k: {"ms": v, "gbps": nbytes / v / 1e6} for k, v in rows.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, row in report["rows"].items():
        print(f"{name:44s} {row['ms']:7.3f} ms {row['gbps']:7.0f} GB/s")


if __name__ == "__main__":
    main()
