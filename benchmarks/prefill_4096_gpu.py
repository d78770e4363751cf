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
The variants and their runners are in benchmarks/prefill_variants.py, the timing in prefill_timing.py, the
profiles in prefill_profile.py; this file is the run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from prefill_cudnn_proposal import propose_entry
from prefill_gaps import short_text
from prefill_profile import gaps, gemm_shapes, kernel_profile
from prefill_timing import host_build_ms, host_syncs, interleaved, logits_agree
from prefill_variants import DEFAULT_VARIANTS, build, runner_for


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
