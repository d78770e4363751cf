"""Where the GPU idles during one prefill: the gap timeline of benchmarks/prefill_4096_gpu.py.

One prefill (then a device synchronize) runs under torch.profiler (CPU ops, CUDA kernels, CUDA runtime and
driver calls; optionally Python frames through with_stack). From the Chrome trace:

    window  |<------------------------- "measured": "prefill" + torch.cuda.synchronize() -------------------->|
    host    |build_batch|emb L0 ... layer_done 0 ... layer_done 31 ... logits| (returns)        cudaDeviceSync |
    GPU     |   idle    |k k k k k  k k k  k  ...   (gap)  k k k ...  k k k k|                  |  idle       |
            ^ before_first_kernel                                             after_last_kernel ^

GPU busy = the union of kernels, memcpys and memsets; each idle interval longer than `min_gap_us` is listed
with its start offset (ms from the window's start), length, the kernels either side, the layer whose launches
the resuming kernel belongs to (by the benchmark's layer_done markers: "layer i" runs from layer i's K/V write
to layer i+1's), when that kernel was launched (launched after the gap began: the host was late, the GPU
starved; before: the GPU waited on something else), and what the host ran meanwhile: CUDA runtime/driver
calls (cudaMalloc, cudaFree, cudaStreamSynchronize, cudaMemcpyAsync, ... with their overlapped us), CPU ops,
the phase annotations and, with stacks, the innermost Python frames at the gap's middle. The summary splits
the idle time into before the first kernel, inside the forward (by layer), and after the last kernel, and
counts the runtime calls of the whole window (a cudaMalloc / cudaFree there is allocator churn).
The profiler slows the host (every op and launch is recorded; Python frames much more so), so a "host late"
gap here may not exist unprofiled: prefill_4096_gpu.py's `X` against `X_queued` is the unprofiled measure.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CALL_CATS = {"cuda_runtime", "cuda_driver"}
ALLOC_STATS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams",
               "segment.all.current", "allocation.all.current")


def memory_counters() -> dict[str, int]:
    """The caching allocator's counters that reveal churn (a retry frees cached blocks: cudaFree syncs the
    device), plus the pinned host allocator's where torch has them."""
    stats = torch.cuda.memory_stats()
    out = {k: int(stats.get(k, 0)) for k in ALLOC_STATS}
    host = getattr(torch.cuda, "host_memory_stats", None)
    if host is not None:
        with contextlib.suppress(Exception):
            h = host()
            out |= {f"host.{k}": int(h.get(k, 0)) for k in ("num_host_alloc", "num_host_free")}
    return out


def counter_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


@contextlib.contextmanager
def annotated(runner: Any, runner_module: Any) -> Iterator[Callable[[int], None]]:
    """Phase ranges around the prefill's parts (patched on this runner only, restored on exit); yields the
    layer_done callback that marks each layer's K/V write."""
    rf = torch.profiler.record_function
    model, build = runner.model, runner_module.build_prefill_batch

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*args: Any, **kwargs: Any) -> Any:
            with rf(name):
                return fn(*args, **kwargs)
        return inner

    model.forward_prefill = wrap("prefill.forward", model.forward_prefill)
    model._logits = wrap("prefill.logits", model._logits)
    runner_module.build_prefill_batch = wrap("prefill.build_batch", build)

    def layer_done(i: int) -> None:
        with rf(f"layer_done {i}"):
            pass
    try:
        yield layer_done
    finally:
        del model.forward_prefill, model._logits  # the instance attributes; the class's methods show again
        runner_module.build_prefill_batch = build


def trace(fn: Callable[[], None], with_stack: bool) -> tuple[list[dict], float]:
    """Chrome-trace events of one fn() + synchronize inside a "measured" range, and its wall ms."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities, with_stack=with_stack) as prof:
        start = time.perf_counter()
        with torch.profiler.record_function("measured"):
            with torch.profiler.record_function("prefill"):
                fn()
            if cuda:
                torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and "dur" in e], wall


def _overlap(e: dict, a: float, b: float) -> float:
    return max(0.0, min(b, e["ts"] + e["dur"]) - max(a, e["ts"]))


def _busy(gpu: list[dict]) -> list[list[float]]:
    merged: list[list[float]] = []
    for e in sorted(gpu, key=lambda e: e["ts"]):
        end = e["ts"] + e["dur"]
        if merged and e["ts"] <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([e["ts"], end])
    return merged


def _host_during(events: dict[str, list[dict]], a: float, b: float) -> dict:
    """What the host ran in [a, b]: runtime calls and CPU ops by overlapped us, annotations, Python stack."""
    def top(cat_events: list[dict], n: int) -> dict[str, float]:
        acc: dict[str, float] = collections.Counter()
        for e in cat_events:
            if (o := _overlap(e, a, b)) > 0:
                acc[e["name"]] += o
        return {k: round(v, 1) for k, v in sorted(acc.items(), key=lambda kv: -kv[1])[:n]}
    mid = (a + b) / 2
    frames = sorted((e for e in events["python_function"] if e["ts"] <= mid <= e["ts"] + e["dur"]),
                    key=lambda e: e["ts"])
    return {"runtime_us": top(events["host_calls"], 6), "cpu_ops_us": top(events["cpu_op"], 5),
            "phases": sorted({e["name"] for e in events["user_annotation"] if _overlap(e, a, b) > 0
                              and e["name"] not in ("measured", "prefill") and not e["name"].startswith("layer_done")}),
            "python_innermost": [e["name"][:120] for e in frames[-6:]]}


def _layer_of(ts: float, markers: list[float]) -> int:
    """-1: before layer 0's K/V write; i: between layer i's marker and layer i+1's."""
    return sum(1 for m in markers if m <= ts) - 1


def gap_timeline(events: list[dict], wall_ms: float, min_gap_us: float = 50.0, max_listed: int = 60,
                 busy_cats: set[str] = GPU_CATS) -> dict:
    """The idle intervals of the "measured" window (see the module docstring) and their summary. busy_cats:
    what counts as the device working (a CPU dry run passes {"cpu_op"} to exercise the plumbing)."""
    window = next(e for e in events if e.get("cat") == "user_annotation" and e["name"] == "measured")
    w0, w1 = window["ts"], window["ts"] + window["dur"]
    inside = [e for e in events if e["ts"] >= w0 and e["ts"] <= w1]
    by_cat: dict[str, list[dict]] = collections.defaultdict(list)
    for e in inside:
        cat = e.get("cat", "")
        by_cat["host_calls" if cat in HOST_CALL_CATS else cat].append(e)
    gpu = sorted((e for c in busy_cats for e in by_cat[c]), key=lambda e: e["ts"])
    if not gpu:
        return {"error": "no GPU activity in the window"}
    launches = {e.get("args", {}).get("correlation"): e for e in by_cat["host_calls"]}
    markers = sorted(e["ts"] for e in by_cat["user_annotation"] if e["name"].startswith("layer_done"))
    busy = _busy(gpu)
    starts = [e["ts"] for e in gpu]
    gaps, small_us, by_layer = [], 0.0, collections.Counter()
    for (_, prev_end), (nxt_start, _) in itertools.pairwise(busy):
        length = nxt_start - prev_end
        nxt = gpu[starts.index(nxt_start)]
        prev = max((e for e in gpu if e["ts"] + e["dur"] <= prev_end + 1e-3), key=lambda e: e["ts"] + e["dur"])
        launch = launches.get(nxt.get("args", {}).get("correlation"))
        layer = _layer_of(launch["ts"], markers) if launch else None
        by_layer[str(layer)] += length
        if length < min_gap_us:
            small_us += length
            continue
        gaps.append({"start_ms": round((prev_end - w0) / 1e3, 3), "us": round(length, 1), "layer": layer,
                     "after": prev["name"][:80], "before": nxt["name"][:80],
                     "launched_ms": round((launch["ts"] - w0) / 1e3, 3) if launch else None,
                     "host_late": bool(launch and launch["ts"] > prev_end), "span_us": (prev_end, nxt_start)})
    calls: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in by_cat["host_calls"]:
        calls[e["name"]][0] += 1
        calls[e["name"]][1] += e["dur"]
    before, after = busy[0][0] - w0, w1 - busy[-1][1]
    enqueue = next((e["dur"] for e in by_cat["user_annotation"] if e["name"] == "prefill"), 0.0)
    listed = sorted(gaps, key=lambda g: -g["us"])[:max_listed]
    for g in listed:  # the host's side only for the listed ones: a with_stack trace holds ~1e4-1e5 frames
        g["host"] = _host_during(by_cat, *g.pop("span_us"))
    return {
        "wall_ms": round(wall_ms, 3), "window_ms": round((w1 - w0) / 1e3, 3),
        "host_enqueue_ms": round(enqueue / 1e3, 3),  # profiled: the profiler slows the host (host_late gaps)
        "host_phases_ms": {e["name"]: round(e["dur"] / 1e3, 3) for e in by_cat["user_annotation"]
                           if e["name"].startswith("prefill.")},
        "gpu_busy_ms": round(sum(b - a for a, b in busy) / 1e3, 3),
        "summary_us": {"before_first_kernel": round(before, 1), "after_last_kernel": round(after, 1),
                       "inside_gaps_over_min": round(sum(g["us"] for g in gaps), 1),
                       "inside_gaps_under_min": round(small_us, 1), "count_over_min": len(gaps),
                       "min_gap_us": min_gap_us},
        "idle_inside_by_layer_us": {k: round(v, 1) for k, v in sorted(by_layer.items(), key=lambda kv: -kv[1])[:12]},
        "runtime_calls": {k: {"count": n, "us": round(us, 1)}
                          for k, (n, us) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:15]},
        "gaps": sorted(listed, key=lambda g: g["start_ms"]),
    }


def short_text(t: dict) -> str:
    """One line for the log."""
    if "error" in t:
        return t["error"]
    s = t["summary_us"]
    worst = sorted(t["gaps"], key=lambda g: -g["us"])[:3]
    return (f"window {t['window_ms']:.1f} ms, host enqueue {t['host_enqueue_ms']:.1f}, GPU busy "
            f"{t['gpu_busy_ms']:.1f}; idle before first kernel "
            f"{s['before_first_kernel'] / 1e3:.2f} ms, inside {s['inside_gaps_over_min'] / 1e3:.2f} in "
            f"{s['count_over_min']} gaps >= {s['min_gap_us']:.0f} us (+{s['inside_gaps_under_min'] / 1e3:.2f} in "
            f"smaller), after last {s['after_last_kernel'] / 1e3:.2f}; largest: "
            + "; ".join(f"{g['us']:.0f} us at {g['start_ms']:.2f} ms layer {g['layer']} "
                        f"{'host late' if g['host_late'] else 'queued'} {list(g['host']['runtime_us'])[:2]}"
                        for g in worst))
