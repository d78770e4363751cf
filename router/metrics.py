"""Prometheus metrics of one router app (its own CollectorRegistry, so several apps can live in a process).

Latencies are measured where the client sees them, at the router: TTFT (request arrival → first token
frame), ITL (gap between token frames), TPOT ((E2E − TTFT) / (completion tokens − 1)), E2E. Names follow
`vllm bench serve` where one exists. Finished requests also go to `recent` (router/recent.py), whose exact
windowed percentiles the status page shows. Worker gauges mirror the last heartbeat / status poll of each worker.

The same registry writes out, when scraped, every worker's own series (router/worker_series.py: labelled by
worker and role) and vLLM's request-level names over these measurements (router/vllm_series.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric

from pdserve.router.recent import RecentRequests
from pdserve.router.registry import Worker, WorkerRegistry
from pdserve.router.vllm_series import VllmSeries
from pdserve.router.worker_series import WorkerSeries

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_WORKER_GAUGES = {
    "queue_len": "requests queued on the worker",
    "num_running": "sequences in the worker's running batch",
    "num_waiting": "sequences waiting on the worker",
    "kv_blocks_used": "KV blocks in use",
    "kv_blocks_total": "KV blocks in the worker's pool",
    "kv_usage_ratio": "fraction of KV blocks in use",
    "transfer_bytes_total": "KV bytes the worker has moved (as it reports them)",
    "transfer_seconds_total": "seconds the worker has spent moving KV (as it reports them)",
}


class LoopHistogram:
    """A Prometheus histogram for one event loop's thread: a bisect and two additions per observation, no lock
    (prometheus_client's takes a mutex per bucket and per sum: 4-5 % of the router's time at ~50k tokens/s,
    one ITL observation each; benchmarks/router_relay.py with --py-spy)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """(upper bound, cumulative count) pairs, +Inf last."""
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        return buckets

    def collect(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, buckets=self.buckets(), sum_value=self.sum)


class RouterMetrics:
    def __init__(self, recent_window_s: float = 300.0, model_name: str = "pdserve") -> None:
        """`model_name`: the `model_name` label of vLLM's names (the served model)."""
        self.recent = RecentRequests(recent_window_s)  # exact recent percentiles for the status page
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = LoopHistogram("pdserve_time_to_first_token_seconds", "arrival to first token", _LATENCY_BUCKETS)
        self.itl = LoopHistogram("pdserve_inter_token_latency_seconds", "gap between token frames", _LATENCY_BUCKETS)
        self.tpot = LoopHistogram("pdserve_time_per_output_token_seconds", "per token after the first",
                                  _LATENCY_BUCKETS)
        self.e2e = LoopHistogram("pdserve_e2e_request_latency_seconds", "arrival to last token", _E2E_BUCKETS)
        self.prefill = LoopHistogram("pdserve_prefill_seconds", "prefill time reported by P", _E2E_BUCKETS)
        self.request_prompt_tokens = LoopHistogram("pdserve_request_prompt_tokens", "prompt tokens per choice",
                                                   _TOKEN_BUCKETS)
        self.request_generation_tokens = LoopHistogram("pdserve_request_generation_tokens",
                                                       "generated tokens per choice", _TOKEN_BUCKETS)
        for histogram in (self.ttft, self.itl, self.tpot, self.e2e, self.prefill, self.request_prompt_tokens,
                          self.request_generation_tokens):
            r.register(histogram)
        self.requests = Counter("pdserve_requests", "finished HTTP requests by status (499: client gone)",
                                ["status"], registry=r)
        self.retries = Counter("pdserve_retries", "worker retries by reason", ["reason"], registry=r)
        self.local_prefills = Counter("pdserve_local_prefills", "sub-requests a decode worker prefilled itself "
                                      "(conditional disaggregation: no prefill worker, no KV transfer)", registry=r)
        self.busy_local_prefills = Counter("pdserve_busy_local_prefills", "fresh prompts a decode worker prefilled "
                                           "itself because every prefill worker was busy (--busy-prefill-backlog) "
                                           "or none was up; also counted in pdserve_local_prefills", registry=r)
        self.local_prefill_fallbacks = Counter("pdserve_local_prefill_fallbacks", "sub-requests sent to a decode "
                                               "worker to prefill there that it held too little of, so a prefill "
                                               "worker computed them", registry=r)
        self.stalled_workers = Counter("pdserve_stalled_workers", "times a worker was found stalled: heartbeats "
                                       "answered, model steps not moving for --stream-stall-timeout", registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens of served requests", registry=r)
        self.cached_tokens = Counter("pdserve_cached_prompt_tokens", "prompt tokens found in the KV cache",
                                     registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "generated tokens", registry=r)
        self.finished_choices = Counter("pdserve_finished_choices", "choices finished, by finish reason (abort: "
                                        "the response ended first: client gone, worker failed)", ["finish_reason"],
                                        registry=r)
        self.workers = Gauge("pdserve_workers", "workers able to take work, by role", ["role"], registry=r)
        self._worker_gauges = {name: Gauge(f"pdserve_worker_{name}", doc, ["worker_id"], registry=r)
                               for name, doc in _WORKER_GAUGES.items()}
        r.register(VllmSeries(self, model_name))  # a collector needs only collect()
        self.worker_series = WorkerSeries(frozenset(m.name for m in r.collect()))
        r.register(self.worker_series)

    def attach(self, workers: WorkerRegistry) -> None:
        """The registry whose workers' own series /metrics carries (the app's, made in its lifespan)."""
        self.worker_series.workers = workers

    def observe_worker(self, worker: Worker) -> None:
        load = worker.load
        values = {"queue_len": load.queue_len, "num_running": load.num_running, "num_waiting": load.num_waiting,
                  "kv_blocks_used": load.used_blocks, "kv_blocks_total": load.total_blocks,
                  "kv_usage_ratio": worker.kv_usage(), "transfer_bytes_total": load.transfer_bytes_total,
                  "transfer_seconds_total": load.transfer_seconds_total}
        for name, value in values.items():
            if value is not None:
                self._worker_gauges[name].labels(worker.worker_id).set(value)

    def forget_worker(self, worker_id: str) -> None:
        for gauge in self._worker_gauges.values():
            try:
                gauge.remove(worker_id)
            except KeyError:  # this gauge was never set for the worker
                pass

    def count_request(self, status: int) -> None:
        self.requests.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StreamTimer:
    """Latencies of one sub-request as its frames arrive (times from time.perf_counter)."""

    __slots__ = ("_arrival", "_last", "_metrics", "first")

    def __init__(self, metrics: RouterMetrics, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self.first: float | None = None  # when the first frame arrived
        self._last = arrival

    def on_frame(self, now: float) -> None:
        if self.first is None:
            self.first = now
            self._metrics.ttft.observe(now - self._arrival)
        else:
            self._metrics.itl.observe(now - self._last)
        self._last = now

    def on_finish(self, completion_tokens: int, prompt_tokens: int, cached_tokens: int,
                  finish_reason: str | None = None) -> None:
        m = self._metrics
        e2e = self._last - self._arrival
        m.e2e.observe(e2e)
        tpot = None
        if self.first is not None and completion_tokens > 1:
            tpot = (self._last - self.first) / (completion_tokens - 1)
            m.tpot.observe(tpot)
        ttft = None if self.first is None else self.first - self._arrival
        m.recent.record(ttft, tpot, e2e, prompt_tokens, cached_tokens)
        m.prompt_tokens.inc(prompt_tokens)
        m.cached_tokens.inc(cached_tokens)
        m.generation_tokens.inc(completion_tokens)
        m.request_prompt_tokens.observe(prompt_tokens)
        m.request_generation_tokens.observe(completion_tokens)
        m.finished_choices.labels(finish_reason or "unknown").inc()
