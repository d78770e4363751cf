"""Prometheus metrics of the router, read from GET /metrics after real requests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m-instruct"


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_latency_histograms_counters_and_worker_gauges(make_cluster) -> None:
    cluster = make_cluster()
    cluster.prefill[0].answer_first = True  # P's answer (its prefill time) before the request ends
    client = cluster.client()
    list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True))
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    httpx.post(f"{cluster.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 0})
    s = _samples(cluster.url)
    assert s[("pdserve_time_to_first_token_seconds_count", ())] == 2
    assert s[("pdserve_inter_token_latency_seconds_count", ())] == 3 + 2  # frames after the first
    assert s[("pdserve_time_per_output_token_seconds_count", ())] == 2
    assert s[("pdserve_e2e_request_latency_seconds_count", ())] == 2
    assert s[("pdserve_prefill_seconds_count", ())] == 2
    assert s[("pdserve_requests_total", (("status", "200"),))] == 2
    assert s[("pdserve_requests_total", (("status", "400"),))] == 1
    assert s[("pdserve_generation_tokens_total", ())] == 7
    assert s[("pdserve_workers", (("role", "decode"),))] == 1
    d_url = cluster.decode_servers[0].url
    assert s[("pdserve_worker_kv_blocks_total", (("worker_id", d_url),))] == 1000
    assert s[("pdserve_worker_kv_usage_ratio", (("worker_id", d_url),))] == 0.0


def test_each_app_has_its_own_registry(make_cluster) -> None:
    first, second = make_cluster(), make_cluster()
    first.client().completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert _samples(first.url)[("pdserve_requests_total", (("status", "200"),))] == 1
    assert ("pdserve_requests_total", (("status", "200"),)) not in _samples(second.url)
