"""The router's console lines, as vLLM prints them: one INFO line per finished request, and every
`interval_s` (10 s) while there is work a stats line per pool.

    Finished request cmpl-7f3a: 200 stop, prompt 812 tokens (512 cached), output 64 tokens, TTFT 0.184 s, E2E 3.02 s
    prefill pool (2 workers): Avg prompt throughput: 5012.3 tokens/s, Avg generation throughput: 0.0 tokens/s,
        Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 62.5%
    decode pool (1 worker): Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 410.7 tokens/s, ...

Pure formatting and arithmetic over numbers handed in (`FinishedRequest`, `WorkerSnapshot`): nothing here touches
a request, a worker or a clock of its own; router/console.py calls it where the numbers are (the relay's end of a
response, the registry's last heartbeats).
"""

from __future__ import annotations

from dataclasses import dataclass, field

POOLS = ("prefill", "decode", "colocated")
_ERROR_CHARS = 300  # an error message longer than this is cut in the request line


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
    finish_reason: str | None = None  # stop, length, abort, ... (several choices: "stop,length")
    error: str | None = None  # the error the client got, if any


def request_line(done: FinishedRequest) -> str:
    reason = f" {done.finish_reason}" if done.finish_reason else ""
    ttft = f"{done.ttft_s:.3f} s" if done.ttft_s is not None else "-"
    line = (f"Finished request {done.request_id}: {done.status}{reason}, prompt {done.prompt_tokens} tokens "
            f"({done.cached_tokens} cached), output {done.output_tokens} tokens, TTFT {ttft}, E2E {done.e2e_s:.2f} s")
    if done.error:
        error = done.error if len(done.error) <= _ERROR_CHARS else done.error[:_ERROR_CHARS] + "..."
        line += f", error: {error}"
    return line


@dataclass(frozen=True)
class WorkerSnapshot:
    """One worker at a stats line, from its last heartbeat. The token counters are cumulative since the worker
    started (prompt tokens computed, tokens generated, prompt tokens looked up in / found in its prefix cache)."""

    worker_id: str
    pool: str  # "prefill" | "decode" | "colocated"
    running: int
    waiting: int
    kv_used_blocks: int
    kv_total_blocks: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0


_COUNTERS = ("prompt_tokens", "generation_tokens", "prefix_queried_tokens", "prefix_hit_tokens")


@dataclass
class PoolStats:
    """A pool over one stats interval: its workers' state now, and what their counters moved since the last
    lines."""

    pool: str
    workers: int = 0
    running: int = 0
    waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting or self.moved["prompt_tokens"] or self.moved["generation_tokens"])

    def line(self, elapsed_s: float) -> str:
        queried, hit = self.moved["prefix_queried_tokens"], self.moved["prefix_hit_tokens"]
        hit_rate = hit / queried if queried > 0 else 0.0
        workers = f"{self.workers} worker{'s' if self.workers != 1 else ''}"
        return (f"{self.pool} pool ({workers}): "
                f"Avg prompt throughput: {self.moved['prompt_tokens'] / elapsed_s:.1f} tokens/s, "
                f"Avg generation throughput: {self.moved['generation_tokens'] / elapsed_s:.1f} tokens/s, "
                f"Running: {self.running} reqs, Waiting: {self.waiting} reqs, "
                f"KV cache usage: {100 * self.kv_usage:.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%")


@dataclass
class StatsLines:
    """`lines(now, workers)` gives one line per pool once `interval_s` has passed since the last ones, and only
    while busy (a pool ran or queued requests, or its workers computed or generated tokens).

    Throughput is what the workers' cumulative counters moved since the last lines, over the seconds since then;
    the prefix hit rate is over the lookups made since then. A worker seen for the first time is a baseline
    (its counters may hold a life before this router); a counter that went down is a restarted worker, counted
    from zero, as Prometheus' rate() counts a reset."""

    interval_s: float = 10.0
    _since: float | None = None
    _last: dict[str, WorkerSnapshot] = field(default_factory=dict)

    def lines(self, now: float, workers: list[WorkerSnapshot]) -> list[str]:
        if self._since is None:
            self._since, self._last = now, {w.worker_id: w for w in workers}
            return []
        elapsed = now - self._since
        if elapsed < self.interval_s * 0.999:  # a sleep of interval_s may wake a hair early
            return []
        pools = self.pools(workers)
        self._since, self._last = now, {w.worker_id: w for w in workers}
        return [p.line(elapsed) for p in pools] if any(p.busy for p in pools) else []

    def pools(self, workers: list[WorkerSnapshot]) -> list[PoolStats]:
        """The pools present, in POOLS order, with the counters' moves since the last lines."""
        by_pool: dict[str, PoolStats] = {}
        for worker in workers:
            pool = by_pool.setdefault(worker.pool, PoolStats(worker.pool))
            pool.workers += 1
            pool.running += worker.running
            pool.waiting += worker.waiting
            pool.kv_used_blocks += worker.kv_used_blocks
            pool.kv_total_blocks += worker.kv_total_blocks
            last = self._last.get(worker.worker_id)
            for name in _COUNTERS:
                pool.moved[name] += _moved(getattr(worker, name), None if last is None else getattr(last, name))
        return [by_pool[name] for name in POOLS if name in by_pool]


def _moved(now: int, before: int | None) -> int:
    if before is None:
        return 0
    return now - before if now >= before else now
