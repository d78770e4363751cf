"""WorkerRegistry: the prefill and decode workers the router knows, with their last reported load.

Two kinds of worker:
  registered  POST /internal/workers/register, then heartbeats; dropped after `timeout_s` of silence.
  static      given on the command line; never dropped, polled (GET /internal/status) by router/health.py.
A worker that refuses a connection is marked unreachable until its next heartbeat or successful poll, so a
dead worker costs at most one failed attempt before the registry notices.

Roles come from the registration (or the command line) and change through the admin API (`set_roles`) or
through a heartbeat whose `roles_version` is newer than the one held (`take_roles`): a switch asked of one
router reaches the others, and a report sent just before the switch cannot undo it. A worker is
left out of `candidates` while it drains, whether the admin API said so here (`draining`) or it reports it, and
while its step threads are stalled (`stalled`: its heartbeats come, but its forwards do not move; router/health.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pdserve.router.prefix_index import CachedPrefixes

ROLES = ("prefill", "decode")


@dataclass
class WorkerLoad:
    """The fields of a heartbeat / status answer."""

    queue_len: int = 0
    num_running: int = 0
    num_waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    draining: bool = False
    transfer_bytes_total: int | None = None  # optional: KV bytes this worker sent or received so far
    transfer_seconds_total: float | None = None
    prefix_hit_rate: float | None = None  # optional: the worker's device prefix cache, blocks hit / looked up
    step_stalled_s: float = 0.0  # seconds since its least recently moving step thread moved (engine/step_liveness.py)
    # optional, for the console's stats lines (router/console.py): vLLM's running / waiting (every queue of
    # the worker, KV transfers awaited included), and cumulative token counters since the worker started
    requests_running: int | None = None
    requests_waiting: int | None = None
    prompt_tokens_computed: int | None = None
    generation_tokens: int | None = None
    prefix_queried_tokens: int | None = None
    prefix_hit_tokens: int | None = None

    @property
    def used_blocks(self) -> int:
        return max(0, self.total_blocks - self.free_blocks)


@dataclass
class Worker:
    worker_id: str
    url: str
    roles: tuple[str, ...]
    static: bool
    last_seen: float
    model: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    transfer: dict[str, Any] = field(default_factory=dict)
    load: WorkerLoad = field(default_factory=WorkerLoad)
    reachable: bool = True
    inflight: int = 0  # sub-requests the router has routed here and not yet finished
    inflight_prompt_tokens: int = 0  # a prefill worker's: prompt tokens of its `inflight` sub-requests
    pending_blocks: int = 0  # blocks reserved here since the last load report (least_kv's correction)
    draining: bool = False  # set by the admin API: no new work from this router, whatever the worker reports
    paused: bool = False  # while the admin API switches its role
    stalled: bool = False  # its step threads stopped moving (router/health.py): no new work until they move
    report_gap_s: float = 0.0  # seconds between its last two reports (a frozen process's gap: router/health.py)
    roles_version: int = 0  # the worker's count of role switches that `roles` reflects
    fingerprint: str | None = None  # the model fingerprint its block hashes are chained with (registration)
    data_port: int | None = None  # where its data plane listens (registration, or a static worker's status)
    prefixes: CachedPrefixes = field(default_factory=CachedPrefixes)  # cache_aware's view of its prefix cache
    # its Prometheus samples as its last heartbeat / status carried them (worker/metrics.py's compact
    # form), decoded only when /metrics is scraped (router/worker_series.py)
    series: list[Any] = field(default_factory=list)

    @property
    def pool(self) -> str:
        """prefill | decode | colocated (both roles): its pool in the console's lines and its `role` label."""
        return "colocated" if len(self.roles) > 1 else self.roles[0]

    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, counting reservations made since the last report."""
        total = self.load.total_blocks or self.num_blocks or 0
        if total <= 0:
            return 1.0
        return min(1.0, (self.load.used_blocks + self.pending_blocks) / total)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("prefixes", "series")}
        out |= {"load": asdict(self.load), "transfer": dict(self.transfer), "roles": list(self.roles),
                "kv_usage": self.kv_usage(), "cached_blocks": len(self.prefixes.reported)}
        return out

    def health(self, silent_s: float, timeout_s: float) -> str:
        """ok | draining | late (silent for two heartbeat intervals: 2/3 of the timeout) | unreachable | stalled."""
        if not self.reachable:
            return "unreachable"
        if self.stalled:
            return "stalled"
        if self.draining or self.load.draining:
            return "draining"
        if not self.static and silent_s > timeout_s * 2 / 3:
            return "late"
        return "ok"


class WorkerRegistry:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout_s = timeout_s
        self._clock = clock
        self._workers: dict[str, Worker] = {}

    def register(self, worker_id: str, url: str, roles: tuple[str, ...], **info: Any) -> Worker:
        _check_roles(roles)
        worker = Worker(worker_id=worker_id, url=url.rstrip("/"), roles=roles, static=False,
                        last_seen=self._clock(), **info)
        self._workers[worker_id] = worker
        return worker

    def add_static(self, url: str, role: str) -> Worker:
        """A command-line worker; listed under both roles when its URL is given for both."""
        _check_roles((role,))
        url = url.rstrip("/")
        worker = self._workers.get(url)
        if worker is None:
            worker = Worker(worker_id=url, url=url, roles=(role,), static=True, last_seen=self._clock(),
                            reachable=False)  # until the first poll answers
            self._workers[url] = worker
        elif role not in worker.roles:
            worker.roles = tuple(r for r in ROLES if r in (*worker.roles, role))
        return worker

    def heartbeat(self, worker_id: str, load: WorkerLoad) -> Worker | None:
        """Record a load report; None when the worker is unknown (it must register again)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return None
        worker.load = load
        now = self._clock()
        worker.report_gap_s, worker.last_seen = max(0.0, now - worker.last_seen), now
        worker.reachable = True
        worker.pending_blocks = 0
        return worker

    def deregister(self, worker_id: str) -> Worker | None:
        """Forget a registered worker at once (it leaves after a drain); static workers stay."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.static:
            return None
        return self._workers.pop(worker_id)

    def set_roles(self, worker_id: str, roles: tuple[str, ...]) -> Worker | None:
        """The roles new work is routed to the worker in (the admin API, once the worker accepted them)."""
        _check_roles(roles)
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.roles = tuple(r for r in ROLES if r in roles)
        return worker

    def take_roles(self, worker: Worker, roles: tuple[str, ...], version: int) -> bool:
        """The roles a worker reports, if they are newer than those held (True when taken)."""
        if version <= worker.roles_version or worker.paused:
            return False
        _check_roles(roles)
        worker.roles = tuple(r for r in ROLES if r in roles)
        worker.roles_version = version
        return True

    def describe(self, worker: Worker) -> dict[str, Any]:
        """`to_dict` plus `health` and seconds since the last report."""
        silent_s = max(0.0, self._clock() - worker.last_seen)
        return {**worker.to_dict(), "health": worker.health(silent_s, self._timeout_s), "silent_s": silent_s}

    def mark_unreachable(self, worker_id: str) -> None:
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.reachable = False

    def expire(self) -> list[Worker]:
        """Drop registered workers silent for longer than the timeout; returns them."""
        now = self._clock()
        dropped = [w for w in self._workers.values() if not w.static and now - w.last_seen > self._timeout_s]
        for worker in dropped:
            del self._workers[worker.worker_id]
        return dropped

    def candidates(self, role: str) -> list[Worker]:
        """Workers that can take new work in `role` now, in registration order."""
        now = self._clock()
        return [w for w in self._workers.values()
                if role in w.roles and w.reachable and not (w.draining or w.paused or w.load.draining or w.stalled)
                and (w.static or now - w.last_seen <= self._timeout_s)]

    def clock(self) -> float:
        return self._clock()

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def static_workers(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.static]


def _check_roles(roles: tuple[str, ...]) -> None:
    if not roles or any(role not in ROLES for role in roles):
        raise ValueError(f"roles must be a non-empty subset of {ROLES}, got {list(roles)}")
