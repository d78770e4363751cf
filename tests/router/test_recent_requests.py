"""RecentRequests: exact nearest-rank percentiles over a time window, rate, cache hit rate."""

from __future__ import annotations

import pytest

from pdserve.router.recent import RecentRequests, percentile


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_nearest_rank_percentiles() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([7.0], 99) == 7.0  # p99 of one request is that request
    assert percentile([], 50) is None


def test_summary_covers_the_window_only() -> None:
    clock = Clock()
    recent = RecentRequests(window_s=60.0, clock=clock)
    recent.record(ttft_s=5.0, tpot_s=0.5, e2e_s=9.0, prompt_tokens=100, cached_tokens=100)  # will age out
    clock.now += 61
    for i in range(10):
        recent.record(ttft_s=0.1 * (i + 1), tpot_s=None if i == 0 else 0.01, e2e_s=1.0, prompt_tokens=10,
                      cached_tokens=5)
        clock.now += 1
    summary = recent.summary()
    assert summary.count == 10
    assert summary.ttft_p50_s == pytest.approx(0.5) and summary.ttft_p99_s == pytest.approx(1.0)
    assert summary.tpot_p50_s == pytest.approx(0.01)  # one-token completions have no TPOT
    assert summary.requests_per_s == pytest.approx(10 / 10)
    assert summary.cache_hit_rate == pytest.approx(0.5)
    assert recent.total_prompt_tokens == 200 and recent.total_cached_tokens == 150  # since start


def test_empty_summary_and_bounded_memory() -> None:
    clock = Clock()
    recent = RecentRequests(window_s=10.0, max_requests=3, clock=clock)
    empty = recent.summary()
    assert empty.count == 0 and empty.ttft_p50_s is None and empty.cache_hit_rate is None
    for i in range(5):
        recent.record(float(i), None, float(i), 1, 0)
    assert recent.summary().count == 3 and recent.summary().ttft_p50_s == 3.0
    with pytest.raises(ValueError, match="positive"):
        RecentRequests(window_s=0)
