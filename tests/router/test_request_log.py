"""router/request_log.py on its own (not yet called by the relay): vLLM-like request and stats lines."""

from __future__ import annotations

from pdserve.router.request_log import FinishedRequest, PoolSnapshot, StatsLines, request_line


def test_one_line_per_finished_request() -> None:
    done = FinishedRequest("cmpl-7f3a", 200, prompt_tokens=812, output_tokens=64, cached_tokens=512, ttft_s=0.1844,
                           e2e_s=3.018, finish_reason="stop")
    assert request_line(done) == ("Finished request cmpl-7f3a: 200 stop, prompt 812 tokens (512 cached), output 64 "
                                  "tokens, TTFT 0.184 s, E2E 3.02 s")
    gone = FinishedRequest("cmpl-1", 499, prompt_tokens=10, output_tokens=0, e2e_s=0.5)
    assert request_line(gone) == "Finished request cmpl-1: 499, prompt 10 tokens (0 cached), output 0 tokens, " \
                                 "TTFT -, E2E 0.50 s"


def _pools(running: int = 0, queried: int = 0, hit: int = 0) -> list[PoolSnapshot]:
    return [PoolSnapshot("prefill", 2, running=0, waiting=running, kv_used_blocks=10, kv_total_blocks=320,
                         prefix_queried_tokens=queried, prefix_hit_tokens=hit),
            PoolSnapshot("decode", 1, running=running, waiting=0, kv_used_blocks=0, kv_total_blocks=0)]


def test_stats_lines_every_interval_while_busy() -> None:
    stats = StatsLines(interval_s=10.0)
    assert stats.lines(0.0, _pools()) == []  # the first call starts the window
    stats.observe(FinishedRequest("a", 200, prompt_tokens=1200, output_tokens=300, cached_tokens=200))
    assert stats.lines(5.0, _pools(running=1)) == []  # not 10 s yet
    prefill, decode = stats.lines(10.0, _pools(running=1, queried=1000, hit=250))
    assert prefill == ("prefill pool (2 workers): Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: "
                       "0.0 tokens/s, Running: 0 reqs, Waiting: 1 reqs, KV cache usage: 3.1%, Prefix cache hit "
                       "rate: 25.0%")
    assert decode == ("decode pool (1 worker): Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 30.0 "
                      "tokens/s, Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 0.0%")
    # the hit rate covers the lookups since the last lines only: 100 more tokens looked up, all found
    again = stats.lines(20.0, _pools(running=1, queried=1100, hit=350))
    assert again[0].endswith("Prefix cache hit rate: 100.0%") and "Avg prompt throughput: 0.0" in again[0]
    assert stats.lines(30.0, _pools()) == []  # idle: silent


def test_a_colocated_pool_counts_both_kinds_of_tokens() -> None:
    stats = StatsLines(interval_s=1.0)
    stats.lines(0.0, [])
    stats.observe(FinishedRequest("a", 200, prompt_tokens=50, output_tokens=20))
    [line] = stats.lines(2.0, [PoolSnapshot("colocated", 1, 0, 0, 5, 10)])
    assert "Avg prompt throughput: 25.0 tokens/s, Avg generation throughput: 10.0 tokens/s" in line
    assert "KV cache usage: 50.0%" in line
