"""Issue 23 item 3 with cuDNN padded to length buckets: one layer's attention of one whole prompt, ours against
cuDNN SDPA through the shipped dispatch (kernels/prefill_attention.py prefill_attention_sdpa, each prompt padded
to a multiple of --bucket rows) and unpadded, at lengths on and between the buckets; and whether a served length
still builds a cuDNN plan once the warm-up has run every bucket.

    OUT=/some/dir python benchmarks/prefill_sdpa_buckets_gpu.py [--bucket 256] [--limit 8192]
    python benchmarks/prefill_sdpa_buckets_gpu.py --dry-run        # CPU check of the script (interpreter, math)

Llama-3-8B heads (32 q / 8 kv, d 128), bf16, pages of 16, q/k/v views of a fused qkv buffer as the model passes
them. First the warm-up: prefill_attention_sdpa once at every sdpa_buckets length from --min-tokens to --limit
(what engine/runner.py warm_up_sdpa does), timed in all. Then per length n: `first_ms` (host clock around one
synchronized call: the first call of padded cuDNN at n after the warm-up, then an unpadded call, whose first
use of shape n builds a plan) and `again_ms` (the same call once more), do_bench medians (L2 flushed) of ours,
padded cuDNN and unpadded cuDNN, and padded cuDNN's output against ours (rel_err). The proposal: the shortest
measured length from which padded cuDNN beats ours at that and every longer measured length.
Writes prefill_sdpa_buckets_h200.json to $OUT (else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from kernels_common import SETTINGS, bench_us, rel_error
from prefill_attention_sdpa import DIM, HKV, HQ, SCALE, build

from pdserve.kernels import prefill_attention_triton as pre
from pdserve.kernels.prefill_attention import prefill_attention_sdpa, sdpa_bucket, sdpa_buckets

LENGTHS = (1024, 1100, 1280, 1536, 1700, 1792, 2000, 2048, 2300, 2560, 3000, 3072, 3500, 4000, 4096, 5000, 6000,
           7000, 8000, 8192)


def host_ms(fn: Callable[[], object]) -> float:
    """Host clock around one call, synchronized before and after (on the CPU: just the call)."""
    if torch.cuda.is_available() and not SETTINGS.dry_run:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available() and not SETTINGS.dry_run:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def warm_up(entry: dict, limit: int, device: str, dtype: torch.dtype) -> dict:
    buckets = sdpa_buckets(entry, limit)
    qkv = torch.randn(buckets[-1], HQ + 2 * HKV, DIM, device=device, dtype=dtype)

    def run() -> None:
        for rows in buckets:
            q, k, v = qkv[:rows].split([HQ, HKV, HKV], dim=1)
            prefill_attention_sdpa(q, k, v, (rows,), SCALE, entry["backend"], entry["bucket"])

    return {"buckets": len(buckets), "first_ms": host_ms(run), "again_ms": host_ms(run)}


def measure(n: int, entry: dict, device: str, dtype: torch.dtype) -> dict:
    c = build([(n, 0)], device, dtype)
    backend, step = entry["backend"], entry["bucket"]
    fns = {"ours": lambda: pre.prefill_attention_triton(c["q"], c["cache"], c["cu"], c["lens"], c["tables"], SCALE),
           "padded": lambda: prefill_attention_sdpa(c["q"], c["k"], c["v"], (n,), SCALE, backend, step),
           "unpadded": lambda: prefill_attention_sdpa(c["q"], c["k"], c["v"], (n,), SCALE, backend)}
    row = {"tokens": n, "bucket": sdpa_bucket(n, step), "first_ms": {}, "again_ms": {}, "times_us": {}, "errors": {}}
    outs = {}
    for name in ("padded", "unpadded", "ours"):  # padded first: its first call is the one a request would make
        try:
            if name != "ours":
                row["first_ms"][name] = host_ms(fns[name])
                row["again_ms"][name] = host_ms(fns[name])
            outs[name] = fns[name]()
            row["times_us"][name] = bench_us(fns[name], rep_ms=40)
        except Exception as exc:  # noqa: BLE001 -- a backend this device does not offer: recorded
            row["errors"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    if "ours" in outs:
        row["rel_err_vs_ours"] = {k: rel_error(o, outs["ours"]) for k, o in outs.items() if k != "ours"}
    return row


def propose(rows: list[dict], entry: dict) -> dict | None:
    start = None
    for r in reversed(rows):
        t = r["times_us"]
        if not (t.get("padded", math.inf) < t.get("ours", math.inf)
                and r.get("rel_err_vs_ours", {}).get("padded", math.inf) < 2e-2):
            break
        start = r["tokens"]
    return None if start is None else {"backend": entry["backend"], "min_tokens": start, "max_seqs": 1,
                                       "bucket": entry["bucket"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket", type=int, default=256)
    parser.add_argument("--min-tokens", type=int, default=1024)
    parser.add_argument("--limit", type=int, default=8192)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (interpreter, math backend)")
    args = parser.parse_args()
    SETTINGS.dry_run = args.dry_run
    device, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    entry = {"backend": "math" if args.dry_run else "cudnn", "min_tokens": args.min_tokens, "bucket": args.bucket}
    lengths = (40, 64, 70) if args.dry_run else [n for n in LENGTHS if args.min_tokens <= n <= args.limit]
    if args.dry_run:
        entry.update(min_tokens=32, bucket=32)
    limit = 96 if args.dry_run else args.limit
    result = {"device": "dry-run" if args.dry_run else torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.date.today().isoformat(), "entry": entry, "limit": limit,
              "command": f"python benchmarks/prefill_sdpa_buckets_gpu.py --bucket {args.bucket} --min-tokens "
                         f"{args.min_tokens} --limit {args.limit}"}
    result["warm_up"] = warm_up(entry, limit, device, dtype)
    print(f"warm-up: {result['warm_up']}", flush=True)
    rows = []
    for n in lengths:
        rows.append(r := measure(n, entry, device, dtype))
        t, f = r["times_us"], r["first_ms"]
        print(f"{n:5d} (bucket {r['bucket']:5d}): ours {t.get('ours', math.nan):7.1f} us, padded "
              f"{t.get('padded', math.nan):7.1f}, unpadded {t.get('unpadded', math.nan):7.1f}; first call padded "
              f"{f.get('padded', math.nan):6.2f} ms (again {r['again_ms'].get('padded', math.nan):.2f}), unpadded "
              f"{f.get('unpadded', math.nan):6.2f} ms; err {r.get('rel_err_vs_ours')}"
              + (f"; failed {r['errors']}" if r["errors"] else ""), flush=True)
    result["rows"], result["proposal"] = rows, propose(rows, entry)
    print(f"proposal: {result['proposal']}")
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "prefill_sdpa_buckets_dry.json" if args.dry_run else "prefill_sdpa_buckets_h200.json"
    (out_dir / name).write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
