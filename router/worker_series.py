"""The workers' own series on the router's `/metrics`: one scrape for the whole deployment.

Each worker's heartbeat (a static worker's status poll) carries every Prometheus sample of its own `/metrics`
in a compact form (worker/metrics.py): the nodes' `pdserve_prefill_*` / `pdserve_decode_*`, the cache
tiers' `pdserve_kv_cache_*` (hits per tier, Redis errors and timeouts, bytes between tiers), KV transfer bytes
and seconds, and vLLM's engine-level names (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, ...). The
router keeps the last one per worker as it came and, when scraped, writes them out with two labels added:

    worker   the worker's id (as in /admin/workers)
    role     prefill | decode | colocated (both roles)

Why the heartbeat rather than a federation endpoint that fetches every worker's /metrics at scrape time: the
numbers already travel to every router once a second, workers bind ports `pdserve serve` picks at random (and
in Kubernetes, pods a scraper would have to discover), and a scrape then never waits on a slow or dead worker:
a worker that stops heartbeating leaves the registry, and its series leave with it. The cost is ~7 KB of
JSON per heartbeat, kept undecoded until a scrape (router/internal_routes.py stores the list as received).

Several routers each carry every worker's series (each gets every heartbeat): aggregate them with
`max by (worker, role)` before summing, as deploy/grafana/pdserve.json does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import Metric

from pdserve.router.registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)
_TYPES = frozenset({"counter", "gauge", "histogram", "summary", "info", "stateset", "gaugehistogram", "unknown"})


class WorkerSeries:
    """A Prometheus collector over the registry's workers (`workers()`); families whose names the router
    exports itself (`reserved`) are left out rather than written twice."""

    def __init__(self, reserved: frozenset[str] = frozenset()) -> None:
        self.reserved = reserved
        self.workers: WorkerRegistry | None = None  # once the app has one (its lifespan started)
        self._warned: set[str] = set()

    def collect(self) -> Iterator[Metric]:
        if self.workers is None:
            return
        families: dict[str, Metric] = {}
        for worker in self.workers.workers():
            try:
                _add(families, worker, self.reserved)
            except (TypeError, ValueError, IndexError, KeyError, AttributeError) as exc:
                if worker.worker_id not in self._warned:  # once per worker: it heartbeats every second
                    self._warned.add(worker.worker_id)
                    log.warning("worker %s sent metrics the router cannot read (%r): some of its series are "
                                "missing from /metrics", worker.worker_id, exc)
        yield from families.values()


def _add(families: dict[str, Metric], worker: Worker, reserved: frozenset[str]) -> None:
    extra = {"worker": worker.worker_id, "role": worker.pool}
    for name, kind, text, samples in worker.series:
        if name in reserved or kind not in _TYPES:
            continue
        family = families.get(name)
        if family is None:
            family = families[name] = Metric(name, text, kind)
        elif family.type != kind:
            continue  # two workers disagree on a family's type (different versions): the first one's stays
        for sample in _samples(samples):
            suffix, value, labels = sample
            family.add_sample(name + suffix, {**labels, **extra}, float(value))


def _samples(samples: Iterable[Any]) -> Iterator[tuple[str, float, dict[str, str]]]:
    for sample in samples:
        labels = sample[2] if len(sample) > 2 else {}
        yield str(sample[0]), sample[1], {str(k): str(v) for k, v in labels.items()}
