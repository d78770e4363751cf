"""router/request_log.py on its own: vLLM-like request and stats lines from numbers handed in (the router's
console, router/console.py, calls it; tests/router/test_router_console.py and tests/e2e/test_console.py read its lines
from real routers)."""

from __future__ import annotations

from pdserve.router.request_log import FinishedRequest, StatsLines, WorkerSnapshot, request_line


def test_one_line_per_finished_request() -> None:
    done = FinishedRequest("cmpl-7f3a", 200, prompt_tokens=812, output_tokens=64, cached_tokens=512, ttft_s=0.1844,
                           e2e_s=3.018, finish_reason="stop")
    assert request_line(done) == ("Finished request cmpl-7f3a: 200 stop, prompt 812 tokens (512 cached), output 64 "
                                  "tokens, TTFT 0.184 s, E2E 3.02 s")
    gone = FinishedRequest("cmpl-1", 499, prompt_tokens=10, output_tokens=0, e2e_s=0.5)
    assert request_line(gone) == "Finished request cmpl-1: 499, prompt 10 tokens (0 cached), output 0 tokens, " \
                                 "TTFT -, E2E 0.50 s"
    failed = FinishedRequest("cmpl-2", 502, 10, 3, ttft_s=0.2, e2e_s=1.0, error="decode worker d-1 failed " + "x" * 400)
    line = request_line(failed)
    assert line.startswith("Finished request cmpl-2: 502, prompt 10 tokens (0 cached), output 3 tokens, TTFT 0.200 s, "
                           "E2E 1.00 s, error: decode worker d-1 failed xxx")
    assert line.endswith("x...") and len(line) < 450


def _workers(running: int = 0, prompt: int = 0, generated: int = 0, queried: int = 0, hit: int = 0,
             restarted: bool = False) -> list[WorkerSnapshot]:
    """Two prefill workers sharing the counters' moves, one decode worker."""
    return [WorkerSnapshot("p0", "prefill", running=0, waiting=running, kv_used_blocks=10, kv_total_blocks=160,
                           prompt_tokens=prompt // 2, prefix_queried_tokens=queried // 2, prefix_hit_tokens=hit // 2),
            WorkerSnapshot("p1", "prefill", 0, 0, 0, 160, prompt_tokens=0 if restarted else prompt - prompt // 2,
                           prefix_queried_tokens=queried - queried // 2, prefix_hit_tokens=hit - hit // 2),
            WorkerSnapshot("d0", "decode", running=running, waiting=0, kv_used_blocks=0, kv_total_blocks=0,
                           generation_tokens=generated)]


def test_stats_lines_every_interval_while_busy() -> None:
    stats = StatsLines(interval_s=10.0)
    assert stats.lines(0.0, _workers(prompt=500, generated=50)) == []  # the first call: a baseline
    assert stats.lines(5.0, _workers(running=1, prompt=900)) == []  # not 10 s yet
    prefill, decode = stats.lines(10.0, _workers(running=1, prompt=1500, generated=350, queried=1000, hit=250))
    assert prefill == ("prefill pool (2 workers): Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: "
                       "0.0 tokens/s, Running: 0 reqs, Waiting: 1 reqs, KV cache usage: 3.1%, Prefix cache hit "
                       "rate: 25.0%")
    assert decode == ("decode pool (1 worker): Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 30.0 "
                      "tokens/s, Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 0.0%")
    # the hit rate covers the lookups since the last lines only: 100 more tokens looked up, all found
    again = stats.lines(20.0, _workers(running=1, prompt=1500, generated=350, queried=1100, hit=350))
    assert again[0].endswith("Prefix cache hit rate: 100.0%") and "Avg prompt throughput: 0.0" in again[0]
    assert stats.lines(30.0, _workers(prompt=1500, generated=350, queried=1100, hit=350)) == []  # idle: silent


def test_a_new_worker_is_a_baseline_and_a_restarted_one_counts_from_zero() -> None:
    stats = StatsLines(interval_s=1.0)
    stats.lines(0.0, _workers(prompt=1000)[:1])
    [line] = stats.lines(1.0, _workers(prompt=1200)[:2])  # p1 appears holding 600: not counted
    assert "Avg prompt throughput: 100.0 tokens/s" in line
    lines = stats.lines(2.0, _workers(prompt=1400, restarted=True))  # p1 back at 0: a reset, not -600
    assert "Avg prompt throughput: 100.0 tokens/s" in lines[0]


def test_a_colocated_pool_counts_both_kinds_of_tokens() -> None:
    stats = StatsLines(interval_s=1.0)
    stats.lines(0.0, [WorkerSnapshot("c0", "colocated", 0, 0, 5, 10)])
    [line] = stats.lines(2.0, [WorkerSnapshot("c0", "colocated", 0, 0, 5, 10, prompt_tokens=50, generation_tokens=20)])
    assert line.startswith("colocated pool (1 worker): Avg prompt throughput: 25.0 tokens/s, Avg generation "
                           "throughput: 10.0 tokens/s")
    assert "KV cache usage: 50.0%" in line
