"""The router's console lines, as vLLM prints them: one INFO line per finished request, and every
`interval_s` (10 s) while there is work a stats line per pool.

    Finished request cmpl-7f3a: 200 stop, prompt 812 tokens (512 cached), output 64 tokens, TTFT 0.184 s, E2E 3.02 s
    prefill pool (2 workers): Avg prompt throughput: 5012.3 tokens/s, Avg generation throughput: 0.0 tokens/s,
        Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 62.5%
    decode pool (1 worker): Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 410.7 tokens/s, ...

Pure formatting and arithmetic over numbers handed in (`FinishedRequest`, `PoolSnapshot`): nothing here touches
a request, a worker or a clock of its own, so the relay and the health monitor stay free to call it where their
numbers are (not wired yet: the router <-> worker data path that would call it is being rewritten).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FinishedRequest:
    """What the router knows of a request when it ends (its client got the last byte, or an error)."""

    request_id: str
    status: int  # the HTTP status the client got; 499: it left
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    ttft_s: float | None = None  # None: no token was sent
    e2e_s: float = 0.0
    finish_reason: str | None = None  # stop, length, abort, ...


def request_line(done: FinishedRequest) -> str:
    reason = f" {done.finish_reason}" if done.finish_reason else ""
    ttft = f"{done.ttft_s:.3f} s" if done.ttft_s is not None else "-"
    return (f"Finished request {done.request_id}: {done.status}{reason}, prompt {done.prompt_tokens} tokens "
            f"({done.cached_tokens} cached), output {done.output_tokens} tokens, TTFT {ttft}, E2E {done.e2e_s:.2f} s")


@dataclass(frozen=True)
class PoolSnapshot:
    """One pool's state at a stats line: summed over its workers' last heartbeats; the prefix counters are
    cumulative (tokens looked up and found since each worker started)."""

    pool: str  # "prefill" | "decode" | "colocated"
    workers: int
    running: int
    waiting: int
    kv_used_blocks: int
    kv_total_blocks: int
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0


@dataclass
class _Counts:
    prompt_tokens: int = 0
    generation_tokens: int = 0


@dataclass
class StatsLines:
    """Accumulates finished requests' tokens; `lines(now, pools)` gives the stats lines once `interval_s` has
    passed since the last ones, and only while busy (tokens moved, or requests running or waiting).

    Prompt tokens count for the prefill pool and generated tokens for the decode pool (a colocated pool gets
    both); throughput is tokens / seconds since the last lines; the prefix hit rate is over the lookups made
    since then (the difference of the cumulative counters)."""

    interval_s: float = 10.0
    _since: float | None = None
    _counts: _Counts = field(default_factory=_Counts)
    _last_prefix: dict[str, tuple[int, int]] = field(default_factory=dict)

    def observe(self, done: FinishedRequest) -> None:
        self._counts.prompt_tokens += done.prompt_tokens - done.cached_tokens
        self._counts.generation_tokens += done.output_tokens

    def lines(self, now: float, pools: list[PoolSnapshot]) -> list[str]:
        if self._since is None:
            self._since = now
            return []
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return []
        busy = self._counts.prompt_tokens or self._counts.generation_tokens or any(p.running or p.waiting
                                                                                   for p in pools)
        out = [self._pool_line(p, elapsed) for p in pools] if busy else []
        for pool in pools:
            self._last_prefix[pool.pool] = (pool.prefix_queried_tokens, pool.prefix_hit_tokens)
        self._since, self._counts = now, _Counts()
        return out

    def _pool_line(self, pool: PoolSnapshot, elapsed: float) -> str:
        prompt = self._counts.prompt_tokens if pool.pool in ("prefill", "colocated") else 0
        generated = self._counts.generation_tokens if pool.pool in ("decode", "colocated") else 0
        queried0, hit0 = self._last_prefix.get(pool.pool, (0, 0))
        queried, hit = pool.prefix_queried_tokens - queried0, pool.prefix_hit_tokens - hit0
        hit_rate = hit / queried if queried > 0 else 0.0
        workers = f"{pool.workers} worker{'s' if pool.workers != 1 else ''}"
        return (f"{pool.pool} pool ({workers}): Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, Running: {pool.running} reqs, "
                f"Waiting: {pool.waiting} reqs, KV cache usage: {100 * pool.kv_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * hit_rate:.1f}%")
