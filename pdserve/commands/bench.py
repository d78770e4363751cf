"""`pdserve bench`: load-test any OpenAI-compatible server; flags as `vllm bench serve` where they overlap."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.bench.client import RequestOutput
    from pdserve.bench.datasets import Conversation
    from pdserve.bench.metrics import BenchmarkMetrics, SLOs
    from pdserve.bench.tokenizer import CountingTokenizer


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server (TTFT, TPOT, ITL, goodput)")
    _add_target_args(p)
    _add_load_args(p)
    _add_dataset_args(p)
    _add_output_args(p)
    p.set_defaults(func=run)


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1", help="host of the server under test")
    g.add_argument("--port", type=int, default=8000, help="port of the server under test")
    g.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                   help="API route the requests go to")
    g.add_argument("--model", default=None, help="model name sent in requests (default: the server's first model)")
    g.add_argument("--tokenizer", default=None,
                   help="HF tokenizer directory to count tokens with (default: the pdserve default model's; "
                        "'none': use the server's usage numbers)")
    g.add_argument("--ignore-eos", action="store_true", help="ask the server to generate max_tokens every time")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests (conversations for multiturn)")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (default: no limit)")
    g.add_argument("--sweep-rate", default=None, help="comma-separated rates: one run each, plus sweep plots")
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "prefix", "multiturn"],
                   help="where prompts come from")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (.json or .json.gz)")
    g.add_argument("--random-input-len", type=int, default=1024, help="prompt length of the random data sets")
    g.add_argument("--random-output-len", type=int, default=128, help="max_tokens of the random data sets")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="uniform lengths in [L(1-r), L(1+r)]; with --random-length-dist normal, std = r·L")
    g.add_argument("--random-length-dist", default="uniform", choices=["uniform", "normal"],
                   help="distribution of the random lengths")
    g.add_argument("--prefix-len", type=int, default=0, help="shared prefix tokens (random and prefix data sets)")
    g.add_argument("--num-prefix-groups", type=int, default=4, help="distinct shared prefixes (prefix data set)")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="override ShareGPT output lengths")
    g.add_argument("--multiturn-turns", type=int, default=4,
                   help="turns per conversation (random) or at most (ShareGPT with --dataset-path)")
    g.add_argument("--multiturn-max-context", type=int, default=2048, help="tokens of history a conversation reaches")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("results")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:200 tpot:50 e2el:5000")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="metrics whose percentiles are reported")
    g.add_argument("--metric-percentiles", default="50,90,99", help="percentiles reported")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--save-detailed", action="store_true", help="also keep every generated text in the JSON")
    g.add_argument("--result-dir", default=".", help="folder of the result JSON and plots")
    g.add_argument("--result-filename", default=None,
                   help="name of the result JSON (default: from the run's settings)")
    g.add_argument("--plot", action="store_true", help="write PNG latency CDFs (and sweep plots) to --result-dir")
    g.add_argument("--label", default=None, help="a name for this run in titles and file names")


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.metrics import METRICS, SLOs

    selected = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    unknown = [m for m in selected if m not in METRICS]
    if unknown:
        print(f"--percentile-metrics: unknown {unknown}; choose from {METRICS}", file=sys.stderr)
        return 2
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    slos = SLOs.parse(args.goodput)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    tokenizer = _tokenizer(args)
    target = _target(args, base_url)
    conversations = _conversations(args, tokenizer)
    if tokenizer is None and (target.chat or args.dataset_name == "multiturn") and args.dataset_path is None:
        print("random prompts without a tokenizer are token ids, which only single-turn /v1/completions "
              "accepts: pass --tokenizer DIR", file=sys.stderr)
        return 2
    rates = [float(r) for r in args.sweep_rate.split(",")] if args.sweep_rate else [args.request_rate]
    runs = [_one_run(args, target, conversations, tokenizer, rate, slos, selected, percentiles) for rate in rates]
    if len(rates) > 1:
        _finish_sweep(args, rates, runs)
    return 0 if all(m.completed for m in runs) else 1


def _tokenizer(args: argparse.Namespace) -> CountingTokenizer | None:
    from pdserve.bench.tokenizer import load_tokenizer

    if args.tokenizer == "none":
        return None
    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    return _default_model_tokenizer()


def _default_model_tokenizer() -> CountingTokenizer | None:
    """The default model's tokenizer (fetched and converted into the model cache on first use, as the server
    does); None, with a note, when it cannot be had: token counts then come from the server's usage."""
    from pdserve.engine.weights.locate import load_tokenizer as load_model_tokenizer
    from pdserve.settings import DEFAULT_MODEL

    try:
        return load_model_tokenizer(DEFAULT_MODEL, os.environ.get("PDSERVE_CACHE_DIR"), progress=True)
    except (OSError, ValueError) as exc:
        print(f"no tokenizer for {DEFAULT_MODEL} ({exc}); counting with the server's usage numbers",
              file=sys.stderr)
        return None


def _target(args: argparse.Namespace, base_url: str) -> Any:
    from pdserve.bench.client import ApiTarget

    model = args.model or _server_model(base_url)
    return ApiTarget(base_url=base_url, endpoint=args.endpoint, model=model, ignore_eos=args.ignore_eos,
                     temperature=args.temperature, api_key=os.environ.get("OPENAI_API_KEY"))


def _server_model(base_url: str) -> str:
    """The first model the server lists at /v1/models."""
    import httpx

    try:
        models = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10.0).json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise SystemExit(f"cannot list models at {base_url}/v1/models ({exc}); pass --model") from exc
    if not models:
        raise SystemExit(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


def _conversations(args: argparse.Namespace, tokenizer: CountingTokenizer | None) -> list[Conversation]:
    from pdserve.bench import datasets, sharegpt

    in_len = datasets.LengthSpec(args.random_input_len, args.random_range_ratio, args.random_length_dist)
    out_len = datasets.LengthSpec(args.random_output_len, args.random_range_ratio, args.random_length_dist)
    n, seed = args.num_prompts, args.seed
    if args.dataset_name in ("sharegpt", "multiturn") and args.dataset_path:
        data = sharegpt.load_sharegpt(args.dataset_path)
        if args.dataset_name == "sharegpt":
            if tokenizer is None:
                raise SystemExit("--dataset-name sharegpt needs a tokenizer to measure lengths: pass --tokenizer")
            return sharegpt.sample_sharegpt(data, n, tokenizer, seed, args.sharegpt_output_len)
        return sharegpt.sample_sharegpt_multiturn(data, n, tokenizer, seed, args.multiturn_turns,
                                                  args.multiturn_max_context)
    if args.dataset_name == "sharegpt":
        raise SystemExit("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON, .gz or not)")
    if args.dataset_name == "multiturn":
        return datasets.sample_random_multiturn(n, args.multiturn_turns, in_len, out_len, tokenizer, seed)
    groups = args.num_prefix_groups if args.dataset_name == "prefix" else 1
    return datasets.sample_random(n, in_len, out_len, tokenizer, seed, args.prefix_len, groups)


def _one_run(args: argparse.Namespace, target: Any, conversations: list[Conversation],
             tokenizer: CountingTokenizer | None, rate: float, slos: SLOs, selected: tuple[str, ...],
             percentiles: list[float]) -> BenchmarkMetrics:
    import asyncio

    from pdserve.bench.metrics import compute_metrics
    from pdserve.bench.report import format_table
    from pdserve.bench.runner import LoadSpec, run_benchmark

    load = LoadSpec(rate, args.burstiness, args.max_concurrency, args.seed, args.request_timeout)
    result = asyncio.run(run_benchmark(conversations, target, load, progress=not args.disable_tqdm))
    metrics = compute_metrics(result.outputs, result.duration, slos, percentiles, tokenizer)
    print(format_table(metrics, selected, slos, title=f"{args.label or 'pdserve bench'} @ {rate:g} req/s"))
    errors = [o.error for o in result.outputs if not o.success]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}", file=sys.stderr)
    info = _run_info(args, target, rate, slos)
    _save(args, metrics, selected, info, result.outputs, slos)
    return metrics


def _run_info(args: argparse.Namespace, target: Any, rate: float, slos: SLOs) -> dict[str, Any]:
    return {"backend": "openai-chat" if target.chat else "openai", "label": args.label, "model_id": target.model,
            "tokenizer_id": args.tokenizer, "endpoint": args.endpoint, "dataset_name": args.dataset_name,
            "num_prompts": args.num_prompts, "request_rate": rate if math.isfinite(rate) else "inf",
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "goodput_slos_ms": slos.to_dict()}


def _save(args: argparse.Namespace, metrics: BenchmarkMetrics, selected: tuple[str, ...], info: dict[str, Any],
          outputs: list[RequestOutput], slos: SLOs) -> None:
    from pdserve.bench import plots, report

    name = args.result_filename or report.default_filename(info)
    if args.sweep_rate and args.result_filename:  # one file per rate
        name = name.removesuffix(".json") + f"-{info['request_rate']}qps.json"
    if args.save_result:
        path = report.save_json(report.result_dict(metrics, selected, info, outputs, args.save_detailed),
                                args.result_dir, name)
        print(f"result saved to {path}")
    if args.plot:
        png = plots.plot_cdfs(metrics, slos, os.path.join(args.result_dir, name.removesuffix(".json") + "-cdf.png"),
                              title=f"{args.label or 'pdserve bench'} @ {info['request_rate']} req/s")
        print(f"latency CDFs saved to {png}")


def _finish_sweep(args: argparse.Namespace, rates: list[float], runs: list[BenchmarkMetrics]) -> None:
    from pdserve.bench import plots, report

    print(f"{'rate':>8} {'throughput':>11} {'goodput':>9} {'p99 TTFT ms':>12} {'p99 TPOT ms':>12}")
    for rate, m in zip(rates, runs):
        print(f"{rate:>8g} {m.request_throughput:>11.2f} {m.request_goodput:>9.2f} "
              f"{plots.p99_ms(m, 'ttft'):>12.1f} {plots.p99_ms(m, 'tpot'):>12.1f}")
    stem = (args.result_filename or f"pdserve-sweep-{args.label or 'run'}").removesuffix(".json")
    if args.save_result:
        summary = {"rates": rates, "runs": [m.to_dict() for m in runs]}
        print(f"sweep saved to {report.save_json(summary, args.result_dir, stem + '-sweep.json')}")
    if args.plot or args.save_result:
        png = plots.plot_sweep(rates, runs, os.path.join(args.result_dir, stem + "-sweep.png"), title=args.label or "")
        print(f"sweep plots saved to {png}")
