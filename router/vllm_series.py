"""vLLM's request-level names on the router's `/metrics`, so that dashboards made for vLLM read pdserve: the
router's own measurements (router/metrics.py) written out a second time, under vLLM's names and with its
`model_name` label, when /metrics is scraped (nothing more is done per token or per request).

    vllm:time_to_first_token_seconds            pdserve_time_to_first_token_seconds (arrival to first token)
    vllm:inter_token_latency_seconds            pdserve_inter_token_latency_seconds (gaps between D's token
    vllm:time_per_output_token_seconds            frames, one token each; the second name is vLLM's older one)
    vllm:request_time_per_output_token_seconds  pdserve_time_per_output_token_seconds (per request)
    vllm:e2e_request_latency_seconds            pdserve_e2e_request_latency_seconds
    vllm:request_prefill_time_seconds           pdserve_prefill_seconds (as P measured it)
    vllm:request_prompt_tokens, ..._generation_tokens   pdserve_request_prompt_tokens, ..._generation_tokens
    vllm:prompt_tokens_total                    pdserve_prompt_tokens_total (cached ones included, as vLLM's)
    vllm:generation_tokens_total                pdserve_generation_tokens_total
    vllm:request_success_total{finished_reason} pdserve_finished_choices_total{finish_reason}

The engine-level names (running, waiting, KV usage, prefix cache queries and hits, preemptions) are each
worker's own, labelled by worker and role (router/worker_series.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

if TYPE_CHECKING:
    from pdserve.router.metrics import LoopHistogram, RouterMetrics


class VllmSeries:
    def __init__(self, metrics: RouterMetrics, model_name: str) -> None:
        self._metrics = metrics
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        for name, histogram in [("vllm:time_to_first_token_seconds", m.ttft),
                                ("vllm:inter_token_latency_seconds", m.itl),
                                ("vllm:time_per_output_token_seconds", m.itl),
                                ("vllm:request_time_per_output_token_seconds", m.tpot),
                                ("vllm:e2e_request_latency_seconds", m.e2e),
                                ("vllm:request_prefill_time_seconds", m.prefill),
                                ("vllm:request_prompt_tokens", m.request_prompt_tokens),
                                ("vllm:request_generation_tokens", m.request_generation_tokens)]:
            yield self._histogram(name, histogram)
        for name, text, counter in [("vllm:prompt_tokens", "prompt tokens of served requests", m.prompt_tokens),
                                    ("vllm:generation_tokens", "generated tokens", m.generation_tokens)]:
            family = CounterMetricFamily(name, text, labels=["model_name"])
            family.add_metric([self._model], sum(_totals(counter).values()))
            yield family
        success = CounterMetricFamily("vllm:request_success", "finished requests (choices) by finish reason",
                                      labels=["finished_reason", "model_name"])
        for reason, value in _totals(m.finished_choices, "finish_reason").items():
            success.add_metric([reason, self._model], value)
        yield success

    def _histogram(self, name: str, histogram: LoopHistogram) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, histogram.documentation, labels=["model_name"])
        family.add_metric([self._model], histogram.buckets(), sum_value=histogram.sum)
        return family


def _totals(counter: Counter, label: str | None = None) -> dict[str, float]:
    """A counter's `_total` samples, by the value of `label` (one entry "" without it)."""
    out: dict[str, float] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                key = sample.labels.get(label, "") if label else ""
                out[key] = out.get(key, 0.0) + sample.value
    return out
