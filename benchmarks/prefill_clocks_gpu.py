"""Why a 4,096-token prefill timed back to back is slower than one timed after the GPU rested: the SM clock,
power and clock-event (throttle) reasons NVML reports while each runs, and the fp8 runner's logits against
bf16's (is cuDNN's different argmax under fp8 linears noise or an error?).

    OUT=/some/dir python benchmarks/prefill_clocks_gpu.py [--reps 30]

Dummy llama3-8b, the shipped dispatch (kernels/prefill_attention_configs.json: cuDNN on whole prompts, padded
to 256-row buckets), eager. Phases, in order, each --reps prefills timed by CUDA events: `back_to_back` (one
after another, synchronized after each: how benchmarks/engine_gpu.py times its prefill row), `rested` (each
after an 80 ms GPU sleep has finished), `back_to_back_again`; then the same for the fp8-linear runner. A
thread samples NVML every ~2 ms throughout; per phase the medians of the samples taken while it ran and the
share of samples with each active clock-event reason. Logits: bf16 ours (the reference), fp8 ours, fp8 cuDNN;
each pair's max |diff|, relative norm, and whether the argmax agrees. Last, the bf16 runner's warm-up
(warm_up_prefill) and prompts of random lengths after it, first call against a second (served_lengths).
Writes prefill_clocks_h200.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from prefill_gaps import GPU_CATS, counter_delta, gap_timeline, memory_counters, trace
from prefill_timing import sleep_cycles, timed_ms
from prefill_variants import build

from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.runner import ModelRunner

dispatcher = importlib.import_module("pdserve.kernels.prefill_attention")
REASONS = {0x1: "gpu_idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal",
           0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


class Sampler(threading.Thread):
    """NVML samples (time, SM MHz, W, reasons bitmask) every ~2 ms until stopped; empty without pynvml."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, int, float, int]] = []
        self.stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception as exc:  # noqa: BLE001 -- no NVML here: the timings still count
            self.nvml, self.error = None, repr(exc)[:200]

    def run(self) -> None:
        if self.nvml is None:
            return
        n, h = self.nvml, self.handle
        reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
        while not self.stop.is_set():
            self.samples.append((time.perf_counter(), n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                                 n.nvmlDeviceGetPowerUsage(h) / 1e3, reasons(h)))
            time.sleep(0.002)

    def summary(self, start: float, end: float) -> dict:
        rows = [s for s in self.samples if start <= s[0] <= end]
        if not rows:
            return {"samples": 0}
        share = {name: round(sum(1 for r in rows if r[3] & bit) / len(rows), 3) for bit, name in REASONS.items()}
        return {"samples": len(rows), "sm_mhz_median": statistics.median(r[1] for r in rows),
                "sm_mhz_min": min(r[1] for r in rows), "power_w_median": statistics.median(r[2] for r in rows),
                "power_w_max": max(r[2] for r in rows), "reason_share": {k: v for k, v in share.items() if v}}


def phase(fn: Callable[[], object], reps: int, rest_cycles: int, sampler: Sampler) -> dict:
    times, start = [], time.perf_counter()
    for _ in range(reps):
        if rest_cycles:
            torch.cuda._sleep(rest_cycles)
            torch.cuda.synchronize()
        times.append(timed_ms(fn, True))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "times_ms": [round(t, 2) for t in times],
            **sampler.summary(start, time.perf_counter())}


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    return {"max_abs_diff": float((a - b).abs().max()), "rel_norm": float((a - b).norm() / b.norm()),
            "same_argmax": bool(torch.equal(a.argmax(-1), b.argmax(-1))), "ref_abs_max": float(b.abs().max())}


def served_lengths(runner: ModelRunner, count: int = 8, profiled: int = 0) -> dict:
    """runner.warm_up_prefill (as a worker starts), then whole prompts of random lengths from the entry's
    min_tokens up to the warm-up's limit: each one's first prefill and a second one, host clock around a
    synchronized call, and the caching allocators' counters around each (a cudaMalloc / cudaHostAlloc on the
    first). A plan built on the request would show as ~50 ms more on the first. The first `profiled` lengths
    are instead traced, both calls (benchmarks/prefill_gaps.py: runtime calls, GPU busy time, idle)."""
    warm_start = time.perf_counter()
    runner.warm_up_prefill(1 << 20)  # the limit is then the pool's: (num_blocks - 1) * block_size tokens
    warm_ms = (time.perf_counter() - warm_start) * 1e3
    limit = (runner.cache_config.num_blocks - 1) * runner.cache_config.block_size
    gen = torch.Generator().manual_seed(23)
    out = {"warm_up_ms": warm_ms, "limit": limit, "sdpa_buckets": runner.warm_up_sdpa(1 << 20), "lengths": {}}
    for i in range(count):
        n = int(torch.randint(1281, limit + 1, (1,), generator=gen))
        chunk = [PrefillChunk([(5 * j + 1) % runner.config.vocab_size for j in range(n)], 0,
                              list(range(-(-n // runner.cache_config.block_size))))]
        row: dict = {}
        for call in ("first", "again"):
            if i < profiled:  # where the first call's extra time goes: runtime calls, GPU busy, idle
                events, wall = trace(lambda c=chunk: runner.prefill(c), with_stack=False)
                t = gap_timeline(events, wall, busy_cats=GPU_CATS)
                row[f"{call}_profiled"] = {"wall_ms": t.get("wall_ms"), "gpu_busy_ms": t.get("gpu_busy_ms"),
                                           "summary_us": t.get("summary_us"), "runtime_calls": t.get("runtime_calls")}
                continue
            before = memory_counters()
            row[f"{call}_ms"] = host_ms(lambda c=chunk: runner.prefill(c))
            row[f"{call}_allocator_delta"] = {k: v for k, v in counter_delta(before, memory_counters()).items() if v}
        out["lengths"][n] = row
    return out


def host_ms(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) * 1e3, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--served-only", action="store_true", help="only served_lengths (bf16 runner)")
    parser.add_argument("--profiled", type=int, default=0, help="served lengths traced instead of timed")
    parser.add_argument("--out-name", default="prefill_clocks_h200.json")
    args = parser.parse_args()
    if args.served_only:
        runners, _ = build("llama3-8b", 4096, "cuda", torch.bfloat16, ("none",))
        result = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(),
                  "entry": dispatcher.sdpa_entry(torch.device("cuda"), torch.bfloat16, 32, 8, 128),
                  "served_after_warm_up": served_lengths(runners["none"], 12, args.profiled)}
        print(json.dumps(result["served_after_warm_up"], indent=1), flush=True)
        return write(result, args.out_name)
    runners, chunks = build("llama3-8b", 4096, "cuda", torch.bfloat16, ("none", "fp8"))
    rest = sleep_cycles(80.0)
    sampler = Sampler()
    sampler.start()
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(),
                    "entry": dispatcher.sdpa_entry(torch.device("cuda"), torch.bfloat16, 32, 8, 128),
                    "nvml": getattr(sampler, "error", "ok"), "phases": {}}
    with torch.inference_mode():
        for quant, runner in runners.items():
            runner.prefill(chunks)
            for name, cycles in (("back_to_back", 0), ("rested", rest), ("back_to_back_again", 0)):
                key = f"{quant}_{name}"
                result["phases"][key] = p = phase(lambda r=runner: r.prefill(chunks), args.reps, cycles, sampler)
                print(f"{key:28s} median {p['median_ms']:7.2f} ms (min {p['min_ms']:.2f}); SM "
                      f"{p.get('sm_mhz_median')} MHz (min {p.get('sm_mhz_min')}), {p.get('power_w_median')} W "
                      f"(max {p.get('power_w_max')}); reasons {p.get('reason_share')}", flush=True)
        sampler.stop.set()
        logits = {"bf16_ours": None, "fp8_ours": None, "fp8_cudnn": None}
        saved = dispatcher.sdpa_entry
        for name in logits:
            runner = runners["fp8" if name.startswith("fp8") else "none"]
            if name.endswith("ours"):
                dispatcher.sdpa_entry = lambda *args: None
            try:
                logits[name] = runner.prefill(chunks).logits.float()
            finally:
                dispatcher.sdpa_entry = saved
        bf16_cudnn = runners["none"].prefill(chunks).logits.float()
    result["logits"] = {"bf16_cudnn_vs_bf16_ours": compare(bf16_cudnn, logits["bf16_ours"]),
                        "fp8_ours_vs_bf16_ours": compare(logits["fp8_ours"], logits["bf16_ours"]),
                        "fp8_cudnn_vs_bf16_ours": compare(logits["fp8_cudnn"], logits["bf16_ours"]),
                        "fp8_cudnn_vs_fp8_ours": compare(logits["fp8_cudnn"], logits["fp8_ours"])}
    for k, v in result["logits"].items():
        print(f"logits {k}: {v}", flush=True)
    result["served_after_warm_up"] = served_lengths(runners["none"])
    print(f"served lengths after the warm-up: {result['served_after_warm_up']}", flush=True)
    write(result, args.out_name)


def write(result: dict, name: str) -> None:
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / name).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
