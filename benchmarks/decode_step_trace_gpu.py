"""One CUDA-graphed decode step, kernel by kernel: where the GPU is busy and where it idles between kernels,
with and without programmatic dependent launch (kernels/pdl.py), for bf16 and fp8 linears.

    python benchmarks/decode_step_trace_gpu.py --out benchmarks/results/decode_step_trace_h200.json   (H200)

Model: `--load-format dummy` llama3-8b (benchmarks/engine_gpu.py's runner and decode inputs). For each run
(`--runs`, engine_gpu.py's --quantization names: none, fp8, with -nopdl / -prefetch / -noprefetch / -reduce), KV cache dtype
(`--kv`) and batch, the step is replayed under torch.profiler (CUPTI reports each kernel of a graph); of the
last of `--replays` replays: its wall (first kernel's start to last kernel's end), the union of kernel intervals (busy), wall - busy
(idle: launch gaps the GPU waits through), the kernel count, and per kernel name its count and summed time.
With PDL, kernels overlap, so the per-name sums can exceed busy time.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_gpu import BLOCK, PREFILL_TOKENS, build_runner, decode_items, run_suffix
from engine_gpu_fp8kv import apply_modifiers

from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.presets import get_preset
from pdserve.kernels import pdl


def step_trace(runner, batch: int, context: int, replays: int) -> dict:
    items = decode_items(batch, context)
    for _ in range(20):
        runner.decode(items)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            runner.decode(items)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()),
                     key=lambda e: e.time_range.start)
    steps, current, last_end = [], [], None
    for e in kernels:  # a step ends where the GPU idles > 200 us (the host syncs between replays)
        if last_end is not None and e.time_range.start - last_end > 200:
            steps.append(current)
            current = []
        current.append(e)
        last_end = e.time_range.end if last_end is None else max(last_end, e.time_range.end)
    steps.append(current)
    step = steps[-1]
    busy, end = 0.0, None
    for e in step:
        s, t = e.time_range.start, e.time_range.end
        if end is None or s >= end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    wall = max(e.time_range.end for e in step) - step[0].time_range.start
    names: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in step:
        short = e.name.split("(")[0][:60]
        names[short][0] += 1
        names[short][1] += e.time_range.elapsed_us()
    return {"batch": batch, "context": context, "steps_seen": len(steps), "kernels": len(step),
            "wall_us": wall, "busy_us": busy, "idle_us": wall - busy,
            "by_kernel": {k: {"count": c, "us": round(us, 1)}
                          for k, (c, us) in sorted(names.items(), key=lambda kv: -kv[1][1])}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="fp8-nopdl,fp8,none-nopdl,none")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--kv", default="auto", help="comma-separated KV cache dtypes, each traced (auto, fp8)")
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_step_trace_h200.json"))
    args = parser.parse_args()
    device = torch.device("cuda")
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(device),
              "model": "llama3-8b (dummy weights)", "runs": {}}
    default = pdl.ENABLED
    batches = [int(b) for b in args.batches.split(",")]
    per_seq = -(-(args.context + 1) // BLOCK)
    for run in args.runs.split(","):
        for kv in args.kv.split(","):
            mods = run.split("-")[1:]
            pdl.ENABLED = "nopdl" not in mods
            apply_modifiers(mods)  # -reduce, -prefetch, -noprefetch
            runner = build_runner(get_preset("llama3-8b"), device, run.split("-")[0], kv,
                                  num_blocks=max(batches) * per_seq + PREFILL_TOKENS // BLOCK + 1)
            prompt = [(7 * j) % runner.config.vocab_size for j in range(PREFILL_TOKENS)]
            runner.prefill([PrefillChunk(prompt, 0, list(range(PREFILL_TOKENS // BLOCK)))])
            rows = [step_trace(runner, b, args.context, args.replays) for b in batches]
            name = (run_suffix(run) or "_bf16") + ("" if kv == "auto" else f"_{kv}kv")
            report["runs"][name] = rows
            for r in rows:
                top = ", ".join(f"{k} {v['count']}x {v['us']:.0f}us" for k, v in list(r["by_kernel"].items())[:6])
                print(f"{run:12s} {kv:5s} b{r['batch']}: {r['kernels']} kernels, wall {r['wall_us']:.0f} us, busy "
                      f"{r['busy_us']:.0f}, idle {r['idle_us']:.0f}; {top}", flush=True)
            del runner
            gc.collect()  # the runner and its graphs hold each other: freed only by the collector
            torch.cuda.empty_cache()
    pdl.ENABLED = default
    apply_modifiers([])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
