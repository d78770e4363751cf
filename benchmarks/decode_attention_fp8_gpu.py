"""Decode attention alone at issue 19's fp8 KV row (batch 64, context 4,096, llama3-8b heads: 32 q, 8 kv, dim 128):
a bf16 cache, an fp8 cache with q and K/V meeting in bf16 (e4m3 -> bf16 goes through fp32 on sm90) and in fp16
(e4m3 -> fp16 is native), each checked against the plain-torch reference. One layer's call, median of 50 after
a warm-up, CUDA events. H200 only.

    python benchmarks/decode_attention_fp8_gpu.py --out benchmarks/results/decode_attention_fp8_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from engine_gpu_baselines import time_ms

from pdserve.kernels.decode_attention import decode_attention_ref
from pdserve.kernels.decode_attention_triton import _launch

BATCH, CONTEXT, Q_HEADS, KV_HEADS, DIM, PAGE = 64, 4096, 32, 8, 128, 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_attention_fp8_h200.json"))
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    per_seq = CONTEXT // PAGE + 1
    blocks = BATCH * per_seq
    q = torch.randn(BATCH, Q_HEADS, DIM, device=device, dtype=torch.bfloat16)
    cache = torch.randn(2, blocks, PAGE, KV_HEADS, DIM, device=device, dtype=torch.bfloat16)
    fp8 = cache.clamp(-448, 448).to(torch.float8_e4m3fn)
    tables = torch.arange(blocks, device=device, dtype=torch.int32).view(BATCH, per_seq)
    lens = torch.full((BATCH,), CONTEXT + 1, device=device, dtype=torch.int32)
    scale = DIM ** -0.5
    ref_bf16 = decode_attention_ref(q, cache, lens, tables, scale).float()
    ref_fp8 = decode_attention_ref(q, fp8, lens, tables, scale).float()
    rows = {}
    for name, kv, f16, ref in (("bf16", cache, False, ref_bf16), ("fp8_bf16_dot", fp8, False, ref_fp8),
                               ("fp8_f16_dot", fp8, True, ref_fp8)):
        def call(kv=kv, f16=f16):
            return _launch(q, kv, lens, tables, scale, f16_dot=f16)
        out = call().float()
        ms = time_ms(call, device, 50, warmup=1)
        kv_bytes = BATCH * (CONTEXT + 1) * KV_HEADS * DIM * 2 * kv.element_size()
        rows[name] = {"ms": ms, "kv_gb_per_s": kv_bytes / ms / 1e6, "max_abs_err": float((out - ref).abs().max())}
        print(name, rows[name], flush=True)
    for config in ((64, 4, 3), (128, 4, 3), (128, 8, 3), (256, 8, 2), (128, 4, 4)):  # the fp8 tile
        def tiled(config=config):
            return _launch(q, fp8, lens, tables, scale, config=config, f16_dot=True)
        rows[f"fp8_f16_dot_tile_{'x'.join(map(str, config))}"] = {"ms": time_ms(tiled, device, 50, warmup=1)}
        print(config, rows[f"fp8_f16_dot_tile_{'x'.join(map(str, config))}"], flush=True)
    # splits: at B 64 x 8 kv heads num_splits_for gives 1 (512 programs); more programs in flight hide the
    # per-tile latency that half the bytes a tile no longer covers?
    for kv, dtype_name, configs in ((cache, "bf16", ((64, 4, 3),)), (fp8, "fp8", ((128, 4, 3), (64, 4, 3), (64, 4, 4),
                                                                                 (128, 4, 2), (256, 4, 2)))):
        ref = ref_bf16 if kv is cache else ref_fp8
        for config in configs:
            for splits in (1, 2, 4, 8):
                def split_call(kv=kv, config=config, splits=splits):
                    return _launch(q, kv, lens, tables, scale, num_splits=splits, config=config)
                key = f"{dtype_name}_tile_{'x'.join(map(str, config))}_splits{splits}"
                err = float((split_call().float() - ref).abs().max())
                rows[key] = {"ms": time_ms(split_call, device, 50, warmup=1), "max_abs_err": err}
                print(key, rows[key], flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "shape": {"batch": BATCH, "context": CONTEXT, "q_heads": Q_HEADS,
                                                     "kv_heads": KV_HEADS, "dim": DIM, "page": PAGE},
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
