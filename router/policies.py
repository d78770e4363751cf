"""Choosing workers. A policy orders the candidates of one role, best first; the relay tries them in that
order (a decode worker may answer 503 when it has no room, and then the next one is asked).

    prefill: round_robin | least_loaded        decode: least_kv | round_robin

`make_prefill_policy(name)` / `make_decode_policy(name)` look a name up in the registries below.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from pdserve.router.registry import Worker


class Policy(ABC):
    @abstractmethod
    def order(self, candidates: list[Worker], prompt_len: int) -> list[Worker]:
        """Candidates best first (the list may be empty)."""


class RoundRobin(Policy):
    """Each call starts one worker further along, so consecutive requests spread evenly."""

    def __init__(self) -> None:
        self._next = 0

    def order(self, candidates: list[Worker], prompt_len: int) -> list[Worker]:
        if not candidates:
            return []
        ordered = sorted(candidates, key=lambda w: w.worker_id)  # stable across registry changes
        start = self._next % len(ordered)
        self._next += 1
        return ordered[start:] + ordered[:start]


class LeastLoaded(Policy):
    """Prefill: fewest queued prompts (last report) plus the router's own in-flight count, which is fresh."""

    def order(self, candidates: list[Worker], prompt_len: int) -> list[Worker]:
        return sorted(candidates, key=lambda w: (w.load.queue_len + w.load.num_waiting + w.inflight, w.worker_id))


class LeastKV(Policy):
    """Decode: lowest KV block usage, counting reservations made since the last report; then fewest running."""

    def order(self, candidates: list[Worker], prompt_len: int) -> list[Worker]:
        return sorted(candidates, key=lambda w: (w.kv_usage(), w.load.num_running + w.inflight, w.worker_id))


PREFILL_POLICIES: dict[str, Callable[[], Policy]] = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}
DECODE_POLICIES: dict[str, Callable[[], Policy]] = {"least_kv": LeastKV, "round_robin": RoundRobin}


def make_prefill_policy(name: str) -> Policy:
    return _make(PREFILL_POLICIES, name, "prefill")


def make_decode_policy(name: str) -> Policy:
    return _make(DECODE_POLICIES, name, "decode")


def _make(table: dict[str, Callable[[], Policy]], name: str, role: str) -> Policy:
    if name not in table:
        raise ValueError(f"unknown {role} policy {name!r}; choose one of {sorted(table)}")
    return table[name]()
