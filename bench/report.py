"""The terminal table (laid out like `vllm bench serve`'s) and the result JSON."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from pdserve.bench.client import RequestOutput
from pdserve.bench.metrics import BenchmarkMetrics, MetricStats, SLOs, percentile_word

_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
_WIDTH = 50


def _row(label: str, value: float | str) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40}{text:>10}"


def format_table(metrics: BenchmarkMetrics, selected: tuple[str, ...], slos: SLOs, title: str = "") -> str:
    """The human-readable summary of one run."""
    lines = [f" {title or 'Serving Benchmark Result'} ".center(_WIDTH, "=")]
    lines += [
        _row("Successful requests:", metrics.completed),
        _row("Failed requests:", metrics.failed),
        _row("Benchmark duration (s):", metrics.duration),
        _row("Total input tokens:", metrics.total_input_tokens),
        _row("Total generated tokens:", metrics.total_output_tokens),
        _row("Request throughput (req/s):", metrics.request_throughput),
    ]
    if slos.is_set():
        lines.append(_row("Request goodput (req/s):", metrics.request_goodput))
    lines += [
        _row("Output token throughput (tok/s):", metrics.output_throughput),
        _row("Total token throughput (tok/s):", metrics.total_token_throughput),
    ]
    for metric in selected:
        s = metrics.stats[metric]
        lines.append(f" {_TITLES[metric]} ".center(_WIDTH, "-"))
        lines += [_row(f"Mean {metric.upper()} (ms):", s.mean_ms), _row(f"Median {metric.upper()} (ms):", s.median_ms)]
        lines += [_row(f"P{percentile_word(p)} {metric.upper()} (ms):", v) for p, v in s.percentiles_ms]
    if metrics.ttft_by_turn:
        lines.append(" TTFT by turn ".center(_WIDTH, "-"))
        for turn, s in metrics.ttft_by_turn.items():
            lines.append(_row(f"Turn {turn} median TTFT (ms):", s.median_ms))
            lines += [_row(f"Turn {turn} P{percentile_word(p)} TTFT (ms):", v) for p, v in s.percentiles_ms]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def result_dict(
    metrics: BenchmarkMetrics,
    selected: tuple[str, ...],
    run_info: dict[str, Any],
    outputs: list[RequestOutput],
    detailed: bool = False,
) -> dict[str, Any]:
    """run_info (model, rate, ...) + vLLM-named metrics + per-request arrays (texts only when detailed)."""
    rows = metrics.per_request
    result: dict[str, Any] = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), **run_info}
    result.update(metrics.to_dict(selected))
    result.update({
        "input_lens": rows.input_lens,
        "output_lens": rows.output_lens,
        "ttfts": rows.ttfts_s,
        "itls": [list(o.itl) for o in outputs if o.success],
        "errors": [o.error for o in outputs if not o.success],
    })
    if metrics.ttft_by_turn:
        result["ttft_by_turn"] = {str(turn): _stats_dict(s) for turn, s in metrics.ttft_by_turn.items()}
    if detailed:
        result["generated_texts"] = [o.generated_text for o in outputs if o.success]
    return result


def _stats_dict(s: MetricStats) -> dict[str, float]:
    """mean_ms, median_ms, std_ms, p90_ms, ... of one statistic."""
    out = {"mean_ms": s.mean_ms, "median_ms": s.median_ms, "std_ms": s.std_ms}
    out.update({f"p{percentile_word(p)}_ms": v for p, v in s.percentiles_ms})
    return out


def default_filename(run_info: dict[str, Any]) -> str:
    """pdserve-bench-<rate>qps-<model>-<date>.json, as vLLM names its files."""
    rate = run_info.get("request_rate", "inf")
    model = str(run_info.get("model_id", "model")).replace("/", "_")
    return f"pdserve-bench-{rate}qps-{model}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"


def save_json(result: dict[str, Any], result_dir: str | Path, filename: str) -> Path:
    path = Path(result_dir) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path
