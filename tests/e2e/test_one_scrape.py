"""One scrape of a real `pdserve serve`: the router's /metrics carries every worker's own series (labelled by
worker and role: tiers, Redis errors, KV transfer bytes and times included), vLLM's names, and every series
deploy/grafana/pdserve.json asks for."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.deployments import MODEL, REPO, Deployment

DASHBOARD = REPO / "deploy" / "grafana" / "pdserve.json"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(url: str) -> Samples:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _requests(deployment: Deployment, count: int = 3) -> None:
    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="x", max_retries=0, timeout=120)
    for _ in range(count):  # the same prompt again: prefix cache hits from the second on
        client.completions.create(model=MODEL, prompt="Tell me about the sea. " * 6, max_tokens=4)


def _settled(deployment: Deployment) -> Samples:
    """The router's samples once a heartbeat has carried the workers' counters of the requests made."""
    time.sleep(2.5)  # heartbeats every second
    return _samples(deployment.url)


def _with(labels: tuple[tuple[str, str], ...], **more: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((*labels, *more.items())))


def test_the_router_carries_every_series_of_every_worker(deployment: Deployment) -> None:
    """Both deployments: roles prefill and decode, and colocated."""
    _requests(deployment)
    routed = _settled(deployment)
    for worker in deployment.workers:
        role = "colocated" if len(worker["roles"]) > 1 else worker["roles"][0]
        own = _samples(worker["url"])
        carried = {(name, labels) for name, labels in own}
        assert carried, f"{worker['worker_id']} exports nothing"
        missing = [(name, labels) for name, labels in carried
                   if (name, _with(labels, worker=worker["worker_id"], role=role)) not in routed]
        assert not missing, f"{worker['worker_id']}'s series missing on the router: {missing[:5]}"


def test_tiers_redis_transfer_and_vllm_names(disaggregated: Deployment) -> None:
    _requests(disaggregated)
    s = _settled(disaggregated)
    [p] = [w["worker_id"] for w in disaggregated.workers if w["roles"] == ["prefill"]]
    [d] = [w["worker_id"] for w in disaggregated.workers if w["roles"] == ["decode"]]
    on_p, on_d = (("role", "prefill"), ("worker", p)), (("role", "decode"), ("worker", d))
    for tier in ("device", "host", "redis"):
        assert ("pdserve_kv_cache_queried_blocks_total", _with(on_p, tier=tier)) in s
    assert s[("pdserve_kv_cache_hit_blocks_total", _with(on_p, tier="device"))] > 0  # the repeated prompt
    assert s[("pdserve_kv_cache_redis_errors_total", on_p)] == 0  # no Redis configured: none tried
    assert ("pdserve_kv_cache_redis_timeouts_total", on_d) in s
    assert s[("pdserve_prefill_transfer_bytes_total", on_p)] > 0  # tcp: P's KV copied to D
    assert s[("pdserve_prefill_transfer_seconds_total", on_p)] > 0
    model = (("model_name", MODEL),)
    assert s[("vllm:prefix_cache_queries_total", _with(on_p, model_name=MODEL))] > 0
    assert 0 < s[("vllm:prefix_cache_hits_total", _with(on_p, model_name=MODEL))] \
        < s[("vllm:prefix_cache_queries_total", _with(on_p, model_name=MODEL))]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total"):
        assert (name, _with(on_d, model_name=MODEL)) in s, name
    assert s[("vllm:time_to_first_token_seconds_count", model)] >= 3
    assert s[("vllm:e2e_request_latency_seconds_count", model)] >= 3
    assert s[("vllm:time_per_output_token_seconds_count", model)] > 0
    assert s[("vllm:request_time_per_output_token_seconds_count", model)] >= 3
    assert s[("vllm:generation_tokens_total", model)] >= 12
    assert s[("vllm:prompt_tokens_total", model)] == s[("pdserve_prompt_tokens_total", ())]
    assert s[("vllm:request_success_total", _with(model, finished_reason="length"))] >= 3


_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                 "offset", "le"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label matchers, ranges, grouping
    clauses and variables are taken out, less the function calls and keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\w+", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    return {name for name, call in re.findall(r"([A-Za-z_:][\w:]*)\s*(\()?", expr)
            if not call and name not in _PROMQL_WORDS}


def dashboard_expressions() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:  # label_values(metric, label): the metric only
        query = variable.get("query")
        if isinstance(query, dict):
            exprs += [m.group(1) for m in [re.match(r"label_values\(([^,]+),", query["query"])] if m]
    return exprs


def test_metric_names_of_promql() -> None:
    assert metric_names('histogram_quantile(0.99, sum by (le) (rate(vllm:e2e_request_latency_seconds_bucket'
                        '{model_name="$model_name"}[$__rate_interval])))') == {"vllm:e2e_request_latency_seconds_bucket"}
    assert metric_names("sum by (role) (max by (worker, role) (a_total)) / max without(x) (b)") == {"a_total", "b"}


def test_the_dashboard_reads_only_series_pdserve_exports(disaggregated: Deployment) -> None:
    _requests(disaggregated)
    exported = {name for name, _ in _settled(disaggregated)}
    exprs = dashboard_expressions()
    read = set().union(*map(metric_names, exprs))
    assert len(exprs) >= 20 and len(read) >= 20
    assert not read - exported, f"the dashboard reads series /metrics does not have: {sorted(read - exported)}"
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total", "pdserve_kv_cache_hit_blocks_total",
                 "pdserve_kv_cache_redis_errors_total", "pdserve_prefill_transfer_bytes_total"):
        assert name in read, f"the dashboard has no panel over {name}"
