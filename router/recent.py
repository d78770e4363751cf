"""RecentRequests: the router's last finished sub-requests, for the percentiles of the status page.

Prometheus histograms (router/metrics.py) answer "how many fell in each bucket since start"; an operator
watching a deployment wants "p50 / p99 over the last minutes", exactly. A bounded ring of the latest requests
gives that without a Prometheus server: `summary()` sorts at most `max_requests` values per latency.

    record(ttft, tpot, e2e, prompt_tokens, cached_tokens)   one per finished sub-request (StreamTimer)
    summary() ─▶ LatencySummary: count, rate, p50/p99 of TTFT, TPOT, E2E, prefix-cache hit rate (tokens)
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class _Finished:
    at: float
    ttft_s: float | None
    tpot_s: float | None  # None for a one-token completion
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class LatencySummary:
    """Percentiles in seconds (None without data) over the requests that finished in the last `window_s`."""

    window_s: float
    count: int
    requests_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    prompt_tokens: int
    cached_tokens: int

    @property
    def cache_hit_rate(self) -> float | None:
        """Share of prompt tokens found in a KV cache (any worker, any tier), None without prompts."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    def to_dict(self) -> dict[str, float | int | None]:
        return {**asdict(self), "cache_hit_rate": self.cache_hit_rate}


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of unsorted values; None when empty.

    Nearest rank rather than interpolation: p99 of 10 requests is the slowest one, a latency that happened."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


class RecentRequests:
    def __init__(self, window_s: float = 300.0, max_requests: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0 or max_requests <= 0:
            raise ValueError(f"window_s and max_requests must be positive, got {window_s} and {max_requests}")
        self.window_s = window_s
        self._clock = clock
        self._finished: deque[_Finished] = deque(maxlen=max_requests)
        self.total_prompt_tokens = 0  # since start, not windowed
        self.total_cached_tokens = 0

    def record(self, ttft_s: float | None, tpot_s: float | None, e2e_s: float, prompt_tokens: int,
               cached_tokens: int) -> None:
        self._finished.append(_Finished(self._clock(), ttft_s, tpot_s, e2e_s, prompt_tokens, cached_tokens))
        self.total_prompt_tokens += prompt_tokens
        self.total_cached_tokens += cached_tokens

    def summary(self) -> LatencySummary:
        now = self._clock()
        recent = [f for f in self._finished if now - f.at <= self.window_s]
        # the rate spans the window, or the time since the oldest request the ring still holds
        span = min(self.window_s, now - recent[0].at) if recent else self.window_s
        ttft = [f.ttft_s for f in recent if f.ttft_s is not None]
        tpot = [f.tpot_s for f in recent if f.tpot_s is not None]
        e2e = [f.e2e_s for f in recent]
        return LatencySummary(
            window_s=self.window_s, count=len(recent), requests_per_s=len(recent) / span if span > 0 else 0.0,
            ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
            tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99),
            e2e_p50_s=percentile(e2e, 50), e2e_p99_s=percentile(e2e, 99),
            prompt_tokens=sum(f.prompt_tokens for f in recent), cached_tokens=sum(f.cached_tokens for f in recent),
        )
