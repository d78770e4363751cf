"""The router's console (router/console.py) and its one scrape (router/worker_series.py, router/vllm_series.py):
a real router app over HTTP in front of FAKE workers (tests/router/fake_workers.py) whose status polls carry
the counters and the compact metrics a real worker's heartbeat does. tests/e2e/test_console.py reads the same
from a real `pdserve serve`."""

from __future__ import annotations

import logging
import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m-instruct"
LINE = re.compile(r"Finished request (?P<id>\S+): (?P<status>\d+)(?: (?P<reason>\S+))?, prompt (?P<prompt>\d+) tokens "
                  r"\((?P<cached>\d+) cached\), output (?P<output>\d+) tokens, TTFT (?P<ttft>[\d.]+ s|-), "
                  r"E2E (?P<e2e>[\d.]+) s(?:, error: (?P<error>.*))?$")


def _lines(caplog: pytest.LogCaptureFixture, pattern: re.Pattern[str] = LINE) -> list[re.Match[str]]:
    return [m for r in caplog.records if r.name == "pdserve.router" and (m := pattern.match(r.getMessage()))]


def _wait_lines(caplog: pytest.LogCaptureFixture, count: int, pattern: re.Pattern[str] = LINE,
                timeout_s: float = 5.0) -> list[re.Match[str]]:
    deadline = time.monotonic() + timeout_s
    while len(found := _lines(caplog, pattern)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_a_line_per_finished_request_streamed_collected_and_failed(make_cluster, caplog) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.router")
    cluster = make_cluster()
    client = cluster.client()
    streamed = list(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, stream=True,
                                              stream_options={"include_usage": True}))
    collected = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=3)
    first, second = _wait_lines(caplog, 2)
    assert first["id"] == streamed[0].id and first["status"] == "200" and first["reason"] == "length"
    assert int(first["prompt"]) == streamed[-1].usage.prompt_tokens and first["output"] == "4"
    assert first["ttft"] != "-" and float(first["ttft"][:-2]) <= float(first["e2e"]) + 0.01
    assert second["id"] == collected.id and second["output"] == "3"
    assert int(second["prompt"]) == collected.usage.prompt_tokens

    no_decode = make_cluster(num_decode=0)  # 503 before any token
    reply = httpx.post(f"{no_decode.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert reply.status_code == 503
    [*_, failed] = _wait_lines(caplog, 3)
    assert failed["status"] == "503" and failed["ttft"] == "-" and failed["output"] == "0"
    assert "no decode worker" in failed["error"]
    assert failed["id"].startswith("cmpl-")


def test_disable_log_requests(make_cluster, caplog) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.router")
    cluster = make_cluster(log_requests=False)
    cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    time.sleep(0.2)
    assert _lines(caplog) == []


STATS = re.compile(r"(?P<pool>\w+) pool \((?P<workers>\d+) workers?\): Avg prompt throughput: (?P<prompt>[\d.]+) "
                   r"tokens/s, Avg generation throughput: (?P<gen>[\d.]+) tokens/s, Running: (?P<running>\d+) reqs, "
                   r"Waiting: (?P<waiting>\d+) reqs, KV cache usage: (?P<kv>[\d.]+)%, Prefix cache hit rate: "
                   r"(?P<hit>[\d.]+)%$")


def test_stats_lines_from_the_workers_counters(make_cluster, caplog) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.router")
    cluster = make_cluster(log_stats_interval_s=0.3)
    p, d = cluster.prefill[0], cluster.decode[0]
    p.extra_status = {"requests_waiting": 3, "prompt_tokens_computed": 0, "prefix_queried_tokens": 0,
                      "prefix_hit_tokens": 0}
    d.extra_status = {"requests_running": 2, "generation_tokens": 0}
    time.sleep(0.7)  # polled, and a stats line or two at these counters
    p.extra_status |= {"prompt_tokens_computed": 4000, "prefix_queried_tokens": 1000, "prefix_hit_tokens": 400}
    d.extra_status |= {"generation_tokens": 600}
    deadline = time.monotonic() + 5
    while not any(m["pool"] == "prefill" and float(m["prompt"]) > 0 for m in _lines(caplog, STATS)):
        assert time.monotonic() < deadline, "no stats line saw the counters move"
        time.sleep(0.05)
    lines = _lines(caplog, STATS)
    moved = next(i for i, m in enumerate(lines) if m["pool"] == "prefill" and float(m["prompt"]) > 0)
    prefill, decode = lines[moved], lines[moved + 1]  # one line per pool, prefill first
    assert prefill["workers"] == "1" and prefill["waiting"] == "3" and prefill["running"] == "0"
    assert float(prefill["hit"]) == pytest.approx(40.0) and float(prefill["gen"]) == 0
    assert decode["pool"] == "decode" and decode["running"] == "2" and float(decode["gen"]) > 0
    assert 1000 < float(prefill["prompt"]) < 20000  # 4000 tokens over one interval of ~0.3 s


def test_no_stats_lines_when_disabled_or_idle(make_cluster, caplog) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.router")
    make_cluster(log_stats_interval_s=0.2)  # idle: nothing moves, nothing queued
    make_cluster(log_stats=False, log_stats_interval_s=0.2).decode[0].extra_status = {"requests_running": 1}
    time.sleep(1.0)
    assert _lines(caplog, STATS) == []


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_worker_series_and_vllm_names_on_the_router(make_cluster, caplog) -> None:
    cluster = make_cluster()
    p, d = cluster.prefill[0], cluster.decode[0]
    p.extra_status = {"metrics": [
        ["pdserve_kv_cache_hit_blocks", "counter", "blocks found, per tier", [["_total", 7, {"tier": "host"}]]],
        ["vllm:num_requests_waiting", "gauge", "waiting", [["", 2, {"model_name": MODEL}]]]]}
    d.extra_status = {"metrics": [["vllm:num_requests_waiting", "gauge", "waiting", [["", 5, {"model_name": MODEL}]]],
                                  "not a family"]}
    cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    time.sleep(0.5)  # a status poll or two
    s = _samples(cluster.url)
    p_id, d_id = cluster.prefill_servers[0].url, cluster.decode_servers[0].url
    assert s[("pdserve_kv_cache_hit_blocks_total", (("role", "prefill"), ("tier", "host"), ("worker", p_id)))] == 7
    waiting = (("model_name", MODEL), ("role", "prefill"), ("worker", p_id))
    assert s[("vllm:num_requests_waiting", waiting)] == 2
    # D's list has a bad entry after a good one: the good one is kept, the rest skipped with one warning
    assert s[("vllm:num_requests_waiting", (("model_name", MODEL), ("role", "decode"), ("worker", d_id)))] == 5
    assert any("cannot read" in r.getMessage() for r in caplog.records)
    model = (("model_name", MODEL),)
    assert s[("vllm:time_to_first_token_seconds_count", model)] == 1
    assert s[("vllm:e2e_request_latency_seconds_count", model)] == 1
    assert s[("vllm:inter_token_latency_seconds_count", model)] == s[("pdserve_inter_token_latency_seconds_count", ())]
    assert s[("vllm:generation_tokens_total", model)] == 3
    assert s[("vllm:prompt_tokens_total", model)] == s[("pdserve_prompt_tokens_total", ())] > 0
    assert s[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", MODEL)))] == 1
    assert s[("vllm:request_generation_tokens_sum", model)] == 3
