"""Issue 23 item 3's "Prefill 4,096 <= 95 ms": where the whole llama3-8b prefill of one 4,096-token prompt goes
(dummy weights, bf16, ModelRunner.prefill, eager), and candidate changes timed side by side in one process.

    OUT=/some/dir python benchmarks/prefill_4096_gpu.py [--rounds 4] [--reps 5] [--variants ours cudnn ...]
    python benchmarks/prefill_4096_gpu.py --dry-run          # CPU check of the plumbing (tiny model, ref path)

Variants (selected here only, by patching module attributes of the dispatcher and the runner; the product is
unchanged):
    ours             our Triton prefill attention everywhere (no SDPA entry; what ships runs cuDNN on whole
                     prompts of >= 1,280 tokens: kernels/prefill_attention_configs.json)
    cudnn            the shipped SDPA dispatch with a cuDNN entry (bucket BUCKET): one call per prompt on the
                     views of the fused qkv buffer (q/k/v strides 6,144 per token), padded to a multiple of
                     BUCKET rows (4,096 is one: no copy), one prompt's output handed on as a view
    cudnn_contig     the same with q, k, v made contiguous [1, H, n, D] first (is it the layout?)
    cudnn_nocopy     cuDNN's output [1, H, n, D] handed on as a [n, H, D] view (the o_proj input reshape then
                     copies once; is it the extra copy?)
    flash            FlashAttention through SDPA on the views
    *_lt             the same with torch.backends.cuda.preferred_blas_library("cublaslt") for the GEMMs
    X_queued         variant X timed behind an 80 ms GPU sleep: all of it queued before its first kernel, so
                     the GPU's own time (X minus X_queued: the idle time the host causes, unprofiled, and
                     whatever back-to-back prefills cost the card's clocks)
    X_rested         variant X timed as X, but each prefill after the same 80 ms GPU sleep has ended (X_rested
                     minus X_queued: the host's delays alone; X minus X_rested: back-to-back load)
    fp8_X            variant X on a second runner with fp8 linears (--quantization fp8, bf16 KV)
    baseline[_X]     variant X (default ours) with the batch built by benchmarks/prefill_baseline_batch.py: the
                     product's before the pinned, non_blocking staging (7 pageable .to(device) copies, each a
                     host sync), so one run times before and after side by side
Variants run interleaved, round by round (each round: every variant --reps times after one untimed call), so
clock or thermal drift over the run lands on all of them alike; per variant the median over all its reps.
Per variant also the host's enqueue time (until prefill() returned) and, for the profiled ones, the
synchronizing calls torch reports in one prefill (set_sync_debug_mode). Then one prefill per variant under
torch.profiler: GPU time per kernel, grouped (gemm, attention, norms, rope
/ kv write, silu_and_mul, copies, other) and the wall minus the kernels' sum (launch gaps, host syncs); and the
four prefill GEMM shapes alone (M = 4,096) through cuBLAS and cuBLASLt, as TFLOP/s. The FLOP floor (~92 ms)
is 2 x 6.98e9 x 4,096 linear FLOPs + attention at the measured rates.
Per variant also the caching allocator's counters over its timed reps (prefill_ms.X.allocator_delta_over_
timed_reps: cudaMalloc / cudaFree / retries, i.e. allocator churn). --gaps X ...: X's gap timeline, the GPU's
idle intervals in one prefill and what the host ran meanwhile (benchmarks/prefill_gaps.py; gap_timelines.X
and, with Python frames, gap_timelines.X_with_stack). cudnn_proposal: a tuning.PREFILL_PATH entry for cuDNN on
whole prompts of >= --tokens where cudnn's median beats ours by more than the larger interquartile range and
in every round (also written as $OUT/prefill_attention_configs.json), else the numbers and why not.
Writes prefill_4096_gpu.json to $OUT (else benchmarks/results/), after every part.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import os
import re
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from prefill_baseline_batch import build_prefill_batch_baseline
from prefill_cudnn_proposal import propose_entry
from prefill_gaps import GPU_CATS, annotated, counter_delta, gap_timeline, memory_counters, short_text, trace

from pdserve.engine import runner as runner_module
from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.presets import get_preset
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights.dummy import dummy_weights

dispatcher = importlib.import_module("pdserve.kernels.prefill_attention")  # the module (the package exports the function)
PAGE = 16
BUCKET = 256  # the cuDNN variants pad each prompt to a multiple of this (kernels/prefill_attention.py)
BASE = ("ours", "cudnn", "cudnn_contig", "cudnn_nocopy", "flash")
DEFAULT_VARIANTS = (*BASE, "ours_lt", "cudnn_contig_lt")
GROUPS = (  # first match wins: (group, regex over the kernel name)
    ("attention", r"prefill_attention|fmha|flash|cudnn|attn|sdpa"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|sm90_|gemv"),
    ("norms", r"rms_norm"),
    ("rope_kv_write", r"rope"),
    ("silu_and_mul", r"silu"),
    ("copies", r"copy|elementwise|Memcpy|Memset|cat|index"),
)


def sdpa_views_nocopy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: tuple[int, ...], scale: float,
                      backend: str, bucket: int = 0) -> torch.Tensor:
    """One prompt: cuDNN's output handed on as a view, unpadded; several: the shipped loop."""
    if len(q_lens) != 1:
        return SHIPPED_SDPA(q, k, v, q_lens, scale, backend, bucket)
    with dispatcher.sdpa_kernel(dispatcher.SDPA_BACKENDS[backend]):
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def sdpa_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: tuple[int, ...], scale: float,
                    backend: str, bucket: int = 0) -> torch.Tensor:
    """The shipped loop on contiguous [1, H, n, D] copies of q, k, v."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    start = 0
    with dispatcher.sdpa_kernel(dispatcher.SDPA_BACKENDS[backend]):
        for n in q_lens:
            rows = slice(start, start + n)
            qs, ks, vs = (t[rows].transpose(0, 1)[None].contiguous() for t in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                                 enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)
            start += n
    return out


SHIPPED_SDPA = dispatcher.prefill_attention_sdpa
SHIPPED_ENTRY = dispatcher.sdpa_entry
SHIPPED_BUILD = runner_module.build_prefill_batch


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """Patch the dispatcher, the batch build and the BLAS library for one variant; restore on exit."""
    name = name.removesuffix("_queued").removesuffix("_rested")  # how it is timed, not what runs (interleaved)
    name = name.removeprefix("fp8_")  # which runner (fp8 linears), not what the dispatch does
    old_batch = name.startswith("baseline")
    base = name.removeprefix("baseline").removeprefix("_") or "ours"
    base = base.removesuffix("_lt")
    backend = {"ours": None, "flash": "flash"}.get(base, "cudnn")
    entry = None if backend is None else {"backend": backend, "min_tokens": 1, "max_seqs": 1, "bucket": BUCKET}
    sdpa = {"cudnn_contig": sdpa_contiguous, "cudnn_nocopy": sdpa_views_nocopy}.get(base, SHIPPED_SDPA)
    blas = torch.backends.cuda.preferred_blas_library() if torch.cuda.is_available() else None
    dispatcher.sdpa_entry = lambda *args: entry
    dispatcher.prefill_attention_sdpa = sdpa
    if old_batch:
        runner_module.build_prefill_batch = build_prefill_batch_baseline
    try:
        if name.endswith("_lt") and blas is not None:
            torch.backends.cuda.preferred_blas_library("cublaslt")
        yield
    finally:
        dispatcher.sdpa_entry, dispatcher.prefill_attention_sdpa = SHIPPED_ENTRY, SHIPPED_SDPA
        runner_module.build_prefill_batch = SHIPPED_BUILD
        if blas is not None:
            torch.backends.cuda.preferred_blas_library(blas)


def build(preset: str, tokens: int, device: str, dtype: torch.dtype,
          quantizations: tuple[str, ...] = ("none",)) -> tuple[dict[str, ModelRunner], list[PrefillChunk]]:
    """One runner per quantization ("none": bf16 linears; "fp8": fp8 linears, bf16 KV), the same dummy weights."""
    config = get_preset(preset)
    weights = dummy_weights(config, dtype, device)
    runners = {q: ModelRunner(config, CacheConfig(num_blocks=tokens // PAGE + 16, block_size=PAGE), weights, device,
                              dtype, max_num_seqs=1, enforce_eager=True, quantization=q) for q in quantizations}
    del weights
    chunk = PrefillChunk([(7 * j + 3) % config.vocab_size for j in range(tokens)], 0, list(range(-(-tokens // PAGE))))
    return runners, [chunk]


def runner_for(runners: dict[str, ModelRunner], name: str) -> ModelRunner:
    """fp8_* variants run on the fp8-linear runner, the rest on bf16's."""
    return runners["fp8" if name.startswith("fp8_") else "none"]


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


def kernel_profile(runner: ModelRunner, chunks: list[PrefillChunk], name: str) -> dict:
    """One prefill under torch.profiler: GPU ms per kernel (top 25), per group, and the wall minus their sum."""
    from torch.profiler import ProfilerActivity, profile

    with variant(name):
        runner.prefill(chunks)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            runner.prefill(chunks)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) * 1e3
    kernels: dict[str, list[float]] = collections.defaultdict(list)
    for ev in prof.events():
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA:
            kernels[ev.name].append(ev.time_range.elapsed_us())  # a device event's own span (us)
    per = {k: {"ms": sum(v) / 1e3, "count": len(v), "mean_us": sum(v) / len(v)} for k, v in kernels.items()}
    groups: dict[str, float] = collections.Counter()
    for kname, row in per.items():
        group = next((g for g, rx in GROUPS if re.search(rx, kname, re.IGNORECASE)), "other")
        groups[group] += row["ms"]
    total = sum(r["ms"] for r in per.values())
    top = dict(sorted(per.items(), key=lambda kv: -kv[1]["ms"])[:25])
    return {"wall_ms_profiled": wall, "kernels_ms": total, "gaps_ms": wall - total,
            "groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])), "top_kernels": top}


def gaps(runner: ModelRunner, chunks: list[PrefillChunk], name: str, with_stack: bool) -> dict:
    """One prefill's gap timeline (benchmarks/prefill_gaps.py) and the allocator's counters around it."""
    with variant(name), annotated(runner, runner_module) as layer_done:
        runner.prefill(chunks, layer_done)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        before = memory_counters() if torch.cuda.is_available() else {}
        events, wall = trace(lambda: runner.prefill(chunks, layer_done), with_stack)
        out = gap_timeline(events, wall, busy_cats=GPU_CATS if torch.cuda.is_available() else {"cpu_op"})
        if torch.cuda.is_available():
            out["allocator_delta"] = counter_delta(before, memory_counters())
    return out


def gemm_shapes(config_name: str, tokens: int, dtype: torch.dtype) -> dict:
    """The prefill's four GEMM shapes alone (x [M, K] @ W[N, K].T), cuBLAS and cuBLASLt, CUDA-event medians."""
    c = get_preset(config_name)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"qkv": (q + 2 * kv, c.hidden_size), "o_proj": (c.hidden_size, q),
              "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}
    out = {}
    saved = torch.backends.cuda.preferred_blas_library()
    try:
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            for name, (n, k) in shapes.items():
                x = torch.randn(tokens, k, device="cuda", dtype=dtype)
                w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
                for _ in range(3):
                    torch.nn.functional.linear(x, w)
                ms = statistics.median(timed_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w), True) for _ in range(20))
                out.setdefault(name, {"n": n, "k": k})[lib] = {"us": ms * 1e3,
                                                                "tflops": 2 * tokens * n * k / (ms * 1e-3) / 1e12}
    finally:
        torch.backends.cuda.preferred_blas_library(saved)
    per_layer = {lib: sum(s[lib]["us"] for s in out.values()) for lib in ("cublas", "cublaslt")}
    return {"shapes": out, "per_layer_us": per_layer,
            "all_layers_ms": {lib: us * c.num_layers / 1e3 for lib, us in per_layer.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--profile", nargs="*", default=["ours", "cudnn", "cudnn_contig"],
                        help="variants profiled kernel by kernel")
    parser.add_argument("--gaps", nargs="*", default=[], help="variants whose GPU idle intervals are traced")
    parser.add_argument("--dry-run", action="store_true", help="CPU: tiny model, the reference path")
    parser.add_argument("--out-name", default="prefill_4096_gpu.json", help="the JSON's file name under $OUT")
    args = parser.parse_args()
    cuda = not args.dry_run
    preset, device = ("llama3-8b", "cuda") if cuda else ("smollm2-135m", "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens = args.tokens if cuda else 64
    out_dir = Path(os.environ.get("OUT") or "benchmarks/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("prefill_4096_cpu_dry.json" if args.dry_run else args.out_name)

    def save() -> None:  # after every part: a later part that fails or runs out of time loses only itself
        path.write_text(json.dumps(result, indent=1) + "\n")

    fp8 = any(n.startswith("fp8_") for n in [*args.variants, *args.profile, *args.gaps])
    runners, chunks = build(preset, tokens, device, dtype, ("none", "fp8") if fp8 else ("none",))
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "tokens": tokens,
                    "model": f"{preset} (dummy weights, {str(dtype).removeprefix('torch.')})",
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "target_ms": 95.0,
                    "rounds": args.rounds, "reps": args.reps}
    with torch.inference_mode():
        result["host_build_batch_ms"] = host_build_ms(chunks, device)
        print(f"host build_prefill_batch {tokens} tokens: {result['host_build_batch_ms']:.3f} ms", flush=True)
        result["prefill_ms"] = interleaved(runners, chunks, args.variants, args.rounds, args.reps, cuda)
        for name, row in result["prefill_ms"].items():
            print(f"prefill {tokens} {name:16s} " + (f"median {row['median_ms']:.2f} ms, min {row['min_ms']:.2f}, "
                                                     f"host enqueue {row['host_enqueue_ms'] or 0:.1f}"
                                                     if "median_ms" in row else row["error"]), flush=True)
        if cuda:
            try:
                result["cudnn_proposal"] = prop = propose_entry({**result["prefill_ms"], "tokens": tokens}, args.reps,
                                                                preset, dtype)
            except Exception as exc:  # noqa: BLE001 -- the timings above still count
                result["cudnn_proposal"] = prop = {"error": repr(exc)[:300]}
            print("cudnn proposal:", {k: v for k, v in prop.items() if k != "proposed"},
                  "entry proposed" if prop.get("proposed") else "no entry", flush=True)
            if prop.get("proposed"):
                (out_dir / "prefill_attention_configs.json").write_text(json.dumps(prop["proposed"], indent=1) + "\n")
        save()
        result["logits_vs_ours"] = logits_agree(runners, chunks, args.variants)
        result["gap_timelines"] = {}
        for name in args.gaps:
            for stack in (False, True):
                key = f"{name}{'_with_stack' if stack else ''}"
                try:
                    result["gap_timelines"][key] = t = gaps(runner_for(runners, name), chunks, name, stack)
                except Exception as exc:  # noqa: BLE001 -- the timings above still count
                    result["gap_timelines"][key] = {"error": repr(exc)[:300]}
                    continue
                print(f"gaps {key}: {short_text(t)}", flush=True)
                save()
        if cuda:
            result["host_syncs"] = {}
            for name in args.profile:
                try:
                    result["host_syncs"][name] = h = host_syncs(runner_for(runners, name), chunks, name)
                except Exception as exc:  # noqa: BLE001 -- the timings above still count
                    result["host_syncs"][name] = {"error": repr(exc)[:300]}
                    continue
                print(f"host syncs {name}: {h['count']} {h['messages']}", flush=True)
            save()
            result["profiles"] = {}
            for name in args.profile:
                try:
                    result["profiles"][name] = p = kernel_profile(runner_for(runners, name), chunks, name)
                except Exception as exc:  # noqa: BLE001 -- the timings above still count
                    result["profiles"][name] = {"error": repr(exc)[:300]}
                    continue
                print(f"profile {name}: wall {p['wall_ms_profiled']:.1f} ms, kernels {p['kernels_ms']:.1f}, gaps "
                      f"{p['gaps_ms']:.1f}; " + ", ".join(f"{g} {ms:.1f}" for g, ms in p["groups_ms"].items()),
                      flush=True)
            save()
            del runners
            torch.cuda.empty_cache()
            result["gemms"] = g = gemm_shapes(preset, tokens, dtype)
            print("gemms alone, all layers (ms):", {k: round(v, 2) for k, v in g["all_layers_ms"].items()},
                  {n: round(s["cublas"]["tflops"]) for n, s in g["shapes"].items()}, flush=True)
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
