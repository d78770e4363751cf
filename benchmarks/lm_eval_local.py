"""lm-eval (`local-completions`) against a real `pdserve serve`, and the same tasks on the offline engine:
the scores agree and so does every request's log-likelihood.

    .venv/bin/python benchmarks/lm_eval_local.py [--tasks pdserve_facts pdserve_facts_greedy] \
        [--batch-sizes 1 8] [--num-concurrent 4] [--tolerance 1e-4] [--torch-threads N] \
        [--out benchmarks/results/lm_eval_local_cpu.json]

Needs lm-eval (`pip install -e .[eval]`), and no hub: the tasks are benchmarks/lm_eval_tasks/*.yaml over a
local JSON file, and the tokenizer lm-eval loads is the default model's, from the directory pdserve converted
the GGUF into (tokenizer.json + tokenizer_config.json, what pdserve itself tokenizes with).

1. `pdserve serve` (default model, default flags: 1P+1D, fp32 on CPU) in its own process group
   (serving_common.Deployment); lm-eval's local-completions scores the tasks through /v1/completions once per
   --batch-sizes entry (1: one token-id prompt per request; 8: a list of 8 in one request), --num-concurrent
   requests in flight. Each request is `echo` + `logprobs: 1` + `max_tokens: 1`; lm-eval sums
   token_logprobs[ctxlen:-1] and calls it greedy when every token equals its top-1.
2. The deployment stopped, the same tasks through lm-eval on pdserve.llm.LLM (benchmarks/lm_eval_offline.py),
   and (unless --no-transformers) on lm-eval's own `hf` model over the same converted fp32 weights, both in
   this process with --torch-threads (give them what each of serve's workers gets, one thread per worker on
   2 cores (pdserve.launcher): on a loaded machine two threads wait on each other at every op; 64 of these
   prompts through LLM.generate took 5.5-12 s with one thread and 34-88 s with two at load 5-9).
3. Per task, the metrics of each server run (and the transformers run) against the offline run's; per request (task, doc, choice), the
   log-likelihood difference and whether is_greedy agrees. Exit status 1 when an accuracy differs, an
   is_greedy disagrees, a log-likelihood is off by more than --tolerance or a perplexity by more than
   --tolerance relative (exp of a mean log-likelihood).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASKS_DIR = REPO / "benchmarks" / "lm_eval_tasks"
MODEL = "smollm2-135m-instruct"
DEFAULT_OUT = "benchmarks/results/lm_eval_local_cpu.json"


def evaluate(model: object, model_args: dict | None, args: argparse.Namespace, batch_size: int = 1) -> dict:
    """One lm-eval run: its metrics per task, every request's (log-likelihood, is_greedy), its wall time."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    out = simple_evaluate(model=model, model_args=model_args, tasks=args.tasks, batch_size=batch_size,
                          task_manager=TaskManager(include_path=str(TASKS_DIR)), log_samples=True,
                          bootstrap_iters=1000)
    wall_s = time.perf_counter() - start
    requests = {f"{task}/{s['doc_id']}/{i}": [float(r[0][0]), bool(r[0][1])]
                for task, samples in out["samples"].items() for s in samples for i, r in enumerate(s["resps"])}
    metrics = {task: {k: v for k, v in values.items() if isinstance(v, float) and "stderr" not in k}
               for task, values in out["results"].items()}
    docs = {task: len(samples) for task, samples in out["samples"].items()}
    return {"wall_s": round(wall_s, 1), "docs": docs, "metrics": metrics, "requests": requests}


def server_runs(args: argparse.Namespace, model_dir: Path) -> dict[str, dict]:
    from serving_common import Deployment

    runs = {}
    log = Path(tempfile.mkdtemp(prefix="lm_eval_local_")) / "serve.log"
    with Deployment(args.port, shlex.split(args.serve_flags), log) as dep:
        for batch_size in args.batch_sizes:
            model_args = {"model": dep.model(), "base_url": f"{dep.url}/v1/completions",
                          "tokenizer": str(model_dir), "num_concurrent": args.num_concurrent}
            runs[f"pdserve serve, batch_size {batch_size}"] = evaluate("local-completions", model_args, args,
                                                                       batch_size)
    return runs


def offline_run(args: argparse.Namespace, model_dir: Path) -> dict:
    from lm_eval_offline import OfflineLM
    from transformers import AutoTokenizer

    from pdserve.llm import LLM

    lm = OfflineLM(LLM(progress=False), AutoTokenizer.from_pretrained(str(model_dir)))
    return evaluate(lm, None, args)


def differs(name: str, value: float, reference: float, tolerance: float) -> bool:
    """Accuracies (acc, acc_norm: counts of items) must be equal; perplexity = exp(-mean log-likelihood) moves
    by a factor of exp(mean difference), so its relative difference may reach the log-likelihood tolerance."""
    if name.startswith("acc"):
        return value != reference
    return abs(value - reference) > tolerance * abs(reference)


def transformers_run(args: argparse.Namespace, model_dir: Path) -> dict:
    """lm-eval's own `hf` model on the same fp32 weights (transformers' LlamaForCausalLM): a reference that
    shares no code with pdserve's engine."""
    return evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}, args, batch_size=8)


def compare(run: dict, reference: dict, tolerance: float) -> dict:
    """How one run differs from the reference: metrics per task, log-likelihoods, is_greedy."""
    diffs = [abs(run["requests"][k][0] - ref[0]) for k, ref in reference["requests"].items()]
    greedy = [k for k, ref in reference["requests"].items() if run["requests"][k][1] != ref[1]]
    metrics = {task: {name: [value, run["metrics"][task][name]] for name, value in values.items()
                      if differs(name, run["metrics"][task][name], value, tolerance)}
               for task, values in reference["metrics"].items()}
    return {"requests": len(diffs), "max_abs_loglikelihood_diff": max(diffs),
            "mean_abs_loglikelihood_diff": sum(diffs) / len(diffs),
            "is_greedy_disagreements": greedy, "metrics_that_differ": {t: m for t, m in metrics.items() if m}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["pdserve_facts", "pdserve_facts_greedy"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--num-concurrent", type=int, default=4)
    parser.add_argument("--serve-flags", default="", help="extra `pdserve serve` flags, one string")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest |log-likelihood difference|")
    parser.add_argument("--no-transformers", action="store_true", help="skip the lm-eval `hf` reference run")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch threads of the offline and transformers runs (this process; default torch's)")
    parser.add_argument("--port", type=int, default=8741)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()
    # the tasks read a local file; nothing may reach for the hub (it is unreachable here, and would be slow)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    os.chdir(REPO)  # the task YAMLs name their data file relative to the repository root
    sys.path.insert(0, str(REPO / "benchmarks"))
    from serving_common import machine_load

    from pdserve.engine.weights.fetch import fetch_default_model

    model_dir = fetch_default_model(progress=False)
    report = report_head(args, machine_load())
    report["server"] = runs = server_runs(args, model_dir)
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    report["offline"] = offline_run(args, model_dir)
    if not args.no_transformers:
        report["transformers"] = transformers_run(args, model_dir)
        runs = {**runs, "transformers (lm-eval hf)": report["transformers"]}
    report["load_at_end"] = machine_load()
    report["agree_within_tolerance"] = summarize(runs, report["offline"], args.tolerance)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["agree_within_tolerance"] else 1


def summarize(runs: dict[str, dict], offline: dict, tolerance: float) -> bool:
    """Each run's `vs_offline`, printed; whether all of them agree with the offline run."""
    ok = True
    for name, run in runs.items():
        c = run["vs_offline"] = compare(run, offline, tolerance)
        ok &= (not c["metrics_that_differ"] and not c["is_greedy_disagreements"]
               and c["max_abs_loglikelihood_diff"] <= tolerance)
        print(f"{name}: {run['metrics']} in {run['wall_s']} s; vs offline: max |Δ loglikelihood| "
              f"{c['max_abs_loglikelihood_diff']:.2e} over {c['requests']} requests, "
              f"{len(c['is_greedy_disagreements'])} is_greedy disagreements, metrics that differ: "
              f"{c['metrics_that_differ'] or 'none'}")
    print(f"offline: {offline['metrics']} in {offline['wall_s']} s")
    return ok


def report_head(args: argparse.Namespace, load: dict) -> dict:
    from importlib.metadata import version

    command = ("benchmarks/lm_eval_local.py --tasks " + " ".join(args.tasks) + " --batch-sizes "
               + " ".join(map(str, args.batch_sizes)) + f" --num-concurrent {args.num_concurrent}"
               + (f" --serve-flags {shlex.quote(args.serve_flags)}" if args.serve_flags else "")
               + f" --tolerance {args.tolerance:g}" + (" --no-transformers" if args.no_transformers else "")
               + (f" --torch-threads {args.torch_threads}" if args.torch_threads is not None else "")
               + (f" --out {args.out}" if args.out != DEFAULT_OUT else ""))
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "command": command,
            "machine": f"this CPU machine ({load['cpus']} cores), shared with other sessions",
            "lm_eval": version("lm_eval"), "model": f"{MODEL} (the default GGUF, Q4_1, dequantized to fp32), on CPU",
            "tolerance": args.tolerance, "load_at_start": load}


if __name__ == "__main__":
    sys.exit(main())
