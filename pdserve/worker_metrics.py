"""The worker gauges that autoscaling reads (deploy/k8s: HorizontalPodAutoscalers through the Prometheus
adapter, deploy/k8s/prometheus-adapter/rules.yaml):

    pdserve_prefill_queued_prompt_tokens   prompt tokens accepted and not yet computed (queued + being
                                           prefilled): P's backlog in the unit its cost grows with
    pdserve_decode_kv_usage                share of the KV pool's blocks held by requests (reserved or running;
                                           cached blocks nobody holds count as free): D's room
    pdserve_decode_num_running (decode_node/node.py) is D's other signal.

Read at scrape time under the worker's state lock, like the nodes' own collectors.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from pdserve.decode_node.node import DecodeNode
from pdserve.prefill_node.node import PrefillNode


def scaling_metrics(prefill: PrefillNode | None, decode: DecodeNode | None,
                    state_lock: threading.RLock) -> Iterator[Metric]:
    with state_lock:
        if prefill is not None:
            batcher = prefill.batcher
            queued = sum(r.remaining for r in batcher.queue) + sum(r.remaining for r in batcher.prefilling)
            yield GaugeMetricFamily("pdserve_prefill_queued_prompt_tokens",
                                    "prompt tokens accepted and not yet computed (queued or being prefilled)", queued)
        if decode is not None:
            pool = decode.scheduler.pool
            yield GaugeMetricFamily("pdserve_decode_kv_usage", "share of KV blocks held by requests", pool.usage)
