"""Issue 23 items 1-2 on a GPU: how long the prefill warm-up takes, and how many Triton compiles served batches
still trigger after it (`compiles_after_warmup`, the key issue 23's item 5 reports), with the step times.

    OUT=/some/dir python benchmarks/prefill_compiles.py [--layers 32] [--budget 2048] [--batches 200]

Dummy llama3-8b (bf16), the serving default token budget; random served batches as
tests/engine/served_batches.py draws them (1-256 chunks up to the budget, half after a cached prefix,
one in five whole new prompts). Compiles are counted by Triton's own post-compile hook
(kernels/specialization.CompileCounter) and cross-checked on the jit functions' caches. Writes
prefill_compiles.json to $OUT (else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

from pdserve.engine.config import CacheConfig
from pdserve.engine.presets import get_preset
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights.dummy import dummy_weights
from pdserve.kernels import specialization

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
from served_batches import BLOCK, NUM_BLOCKS, served_batch


def timed_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    config = dataclasses.replace(get_preset("llama3-8b"), num_layers=args.layers, max_model_len=16384)
    runner = ModelRunner(config, CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK),
                         dummy_weights(config, torch.bfloat16, "cuda"), "cuda", torch.bfloat16, max_num_seqs=256,
                         enforce_eager=True)
    with specialization.CompileCounter() as during:
        warm_ms = timed_ms(lambda: runner.warm_up_prefill(args.budget))
    cached = specialization.cached_kernels()
    gen = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(args.batches):
        chunks = served_batch(gen, args.budget, config.max_model_len - 1)
        batches.append([dataclasses.replace(c, block_table=[b % NUM_BLOCKS for b in c.block_table]) for c in chunks])
    steps = []
    with specialization.CompileCounter() as after:
        for chunks in batches:
            ms = timed_ms(lambda c=chunks: runner.prefill(c))
            steps.append({"chunks": len(chunks), "tokens": sum(len(c.token_ids) for c in chunks), "ms": ms})
    times = sorted(s["ms"] for s in steps)
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.date.today().isoformat(), "layers": args.layers, "budget": args.budget,
        "warm_up_ms": warm_ms, "warm_up_prefills": len(runner.prefill_warm_up_batches(args.budget)),
        "compiles_during_warmup": len(during.compiled), "compiles_after_warmup": len(after.compiled),
        "compiled_after_warmup": after.compiled[:20], "cache_entries_grew_by": specialization.cached_kernels() - cached,
        "step_ms_p50": times[len(times) // 2], "step_ms_p99": times[min(len(times) - 1, int(0.99 * len(times)))],
        "step_ms_max": times[-1], "steps": steps,
        "command": f"python benchmarks/prefill_compiles.py --layers {args.layers} --budget {args.budget}",
    }
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"prefill_compiles_{args.budget}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"warm-up: {result['warm_up_prefills']} prefills, {warm_ms / 1e3:.1f} s, {len(during.compiled)} compiles; "
          f"after it, {args.batches} served batches: {len(after.compiled)} compiles "
          f"(cache +{result['cache_entries_grew_by']}); step p50/p99/max {result['step_ms_p50']:.1f}/"
          f"{result['step_ms_p99']:.1f}/{result['step_ms_max']:.1f} ms")


if __name__ == "__main__":
    main()
