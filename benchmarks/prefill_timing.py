"""How benchmarks/prefill_4096_gpu.py times a prefill: CUDA events (optionally behind a GPU sleep), the host's
enqueue time, variants interleaved round by round, the synchronizing calls torch reports, and each variant's
logits against ours.
"""

from __future__ import annotations

import collections
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from prefill_gaps import counter_delta, memory_counters
from prefill_variants import PAGE, runner_for, variant

from pdserve.engine import runner as runner_module
from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.runner import ModelRunner


def host_build_ms(chunks: list[PrefillChunk], device: str, reps: int = 50) -> float:
    """Median host ms of build_prefill_batch alone (numpy + pinned staging + the two non_blocking copies)."""
    times = []
    for _ in range(reps + 3):
        start = time.perf_counter()
        runner_module.build_prefill_batch(chunks, PAGE, torch.device(device))
        times.append((time.perf_counter() - start) * 1e3)
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times[3:])


def timed_ms(fn: Callable[[], object], cuda: bool, host: list[float] | None = None, sleep_cycles: int = 0) -> float:
    """GPU ms of fn (CUDA events); host, if given, gets the ms until fn returned (its enqueue time: where that
    reaches the GPU time the prefill is host-bound, or a sync inside made the host wait). sleep_cycles > 0:
    the GPU first spins that long (torch.cuda._sleep), so a sync-free fn is wholly queued before its first
    kernel starts and the events time the GPU's own work, without any gap the host causes."""
    start = time.perf_counter()
    if not cuda:
        fn()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    begin.record()
    fn()
    end.record()
    if host is not None:
        host.append((time.perf_counter() - start) * 1e3)
    end.synchronize()
    return begin.elapsed_time(end)


def sleep_cycles(ms: float) -> int:
    """GPU clock cycles of torch.cuda._sleep that last about `ms` (calibrated here)."""
    cycles = 20_000_000
    torch.cuda._sleep(cycles)  # untimed: clocks up
    took = timed_ms(lambda: torch.cuda._sleep(cycles), True)
    return int(cycles * ms / took)


def host_syncs(runner: ModelRunner, chunks: list[PrefillChunk], name: str) -> dict:
    """Synchronizing calls torch reports in one prefill (torch.cuda.set_sync_debug_mode("warn")): a sync per
    layer would drain the GPU's queue each layer (the GPU then idles while the host launches the next ops)."""
    with variant(name), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            runner.prefill(chunks)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    messages = collections.Counter(str(w.message).splitlines()[0][:120] for w in caught)
    return {"count": sum(messages.values()), "messages": dict(messages.most_common(5))}


def interleaved(runners: dict[str, ModelRunner], chunks: list[PrefillChunk], names: list[str], rounds: int,
                reps: int, cuda: bool) -> dict:
    """Per variant the CUDA-event times of `reps` prefills a round; an `*_queued` variant is timed behind an
    80 ms GPU sleep (timed_ms), i.e. the GPU's own time for that prefill; a `*_rested` one after the same
    sleep has finished (synchronized), so timed as the plain variant, host delays included, but after 80 ms
    of no heavy work (X minus X_rested: what back-to-back prefills cost in the card's clocks)."""
    pause = sleep_cycles(80.0) if cuda and any(n.endswith(("_queued", "_rested")) for n in names) else 0
    times: dict[str, list[float]] = {n: [] for n in names}
    hosts: dict[str, list[float]] = {n: [] for n in names}
    churn: dict[str, collections.Counter] = {n: collections.Counter() for n in names}
    errors: dict[str, str] = {}
    for _ in range(rounds):
        for name in names:
            if name in errors:
                continue
            runner = runner_for(runners, name)
            try:
                with variant(name):
                    runner.prefill(chunks)  # untimed: plans, caches
                    before = memory_counters() if cuda else {}
                    cycles = pause if name.endswith("_queued") else 0
                    for _ in range(reps):
                        if name.endswith("_rested") and cuda:
                            torch.cuda._sleep(pause)
                            torch.cuda.synchronize()
                        times[name].append(timed_ms(lambda r=runner: r.prefill(chunks), cuda, hosts[name], cycles))
                    if cuda:
                        churn[name].update(counter_delta(before, memory_counters()))
            except Exception as exc:  # noqa: BLE001 -- a backend this device does not offer: recorded, others go on
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    out = {n: {"median_ms": statistics.median(t), "min_ms": min(t), "times_ms": [round(x, 3) for x in t],
               "host_enqueue_ms": statistics.median(hosts[n]) if hosts[n] else None,
               "allocator_delta_over_timed_reps": dict(churn[n])}
           for n, t in times.items() if t}
    for name, err in errors.items():
        out[name] = {"error": err}
    return out


def logits_agree(runners: dict[str, ModelRunner], chunks: list[PrefillChunk], names: list[str]) -> dict:
    """Each variant's last-row logits against ours on the same runner: max abs difference and the argmax."""
    refs = {}
    for q, runner in runners.items():
        with variant("ours"):
            refs[q] = runner.prefill(chunks).logits.float()
    out = {}
    for name in names:
        runner = runner_for(runners, name)
        ref = refs["fp8" if name.startswith("fp8_") else "none"]
        try:
            with variant(name):
                got = runner.prefill(chunks).logits.float()
        except Exception as exc:  # noqa: BLE001 -- a backend this device does not offer
            out[name] = {"error": repr(exc)[:200]}
            continue
        out[name] = {"max_abs_diff": float((got - ref).abs().max()),
                     "same_argmax": bool(torch.equal(got.argmax(-1), ref.argmax(-1)))}
    return out
