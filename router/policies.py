"""Choosing workers. A policy orders the candidates of one role, best first; the relay tries them in that
order (a decode worker may answer 503 when it has no room, and then the next one is asked).

    prefill: cache_aware (default) | round_robin | least_loaded   decode: least_kv (default) | cache_aware | round_robin

`cache_aware` sends a prompt to the prefill worker that holds the longest prefix of it (device or host RAM;
Redis is shared by all, so it does not tell them apart), unless that worker has more than `max_imbalance`
requests queued beyond the least loaded one: then the least loaded. Equal prefixes (none, typically) go to
the least loaded, rotating among equals. What a worker holds comes from its heartbeats (`cached_blocks`, a
bounded summary of block hashes) and from the prompts the router sent it since (router/prefix_index.py); the
prompt's chained block hashes are computed here with the worker's model fingerprint and the request's
cache_salt, exactly as the workers compute them (cache_store/hashing.py).

Decode `cache_aware` puts first the decode worker holding the longest prefix of the prompt (its finished
sequences: an earlier turn of the conversation), so that P sends only the rest (decode_node/prefix.py); least_kv's
order otherwise, among equals, and whenever that worker runs more than `max_imbalance` requests beyond the least
busy one. Its view of a decode worker: the same heartbeats, plus the blocks of every sequence this router saw
finish there (router/decode_reuse.py).

`make_prefill_policy(name, options)` / `make_decode_policy(name)` look a name up in the registries below.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.cache_store.hashing import block_hashes, prefix_lookup
from pdserve.router.registry import Worker


@dataclass(frozen=True)
class PolicyOptions:
    block_size: int = 16
    max_imbalance: int = 4  # cache_aware: queued requests beyond the least loaded worker it tolerates


@dataclass(frozen=True)
class Prompt:
    """What a prefix-aware policy needs of a request; block hashes are computed once per fingerprint."""

    token_ids: Sequence[int]
    cache_salt: str | None = None
    _hashes: dict[tuple[str, int], list[bytes]] = field(default_factory=dict, compare=False, repr=False)

    def hashes(self, fingerprint: str, block_size: int) -> list[bytes]:
        """The chained hashes of every full block (what a prefill worker commits)."""
        key = (fingerprint, block_size)
        if key not in self._hashes:
            self._hashes[key] = block_hashes(self.token_ids, block_size, fingerprint, self.cache_salt)
        return self._hashes[key]


class Policy(ABC):
    @abstractmethod
    def order(self, candidates: list[Worker], prompt_len: int, prompt: Prompt | None = None) -> list[Worker]:
        """Candidates best first (the list may be empty)."""

    def routed(self, worker: Worker, prompt: Prompt) -> None:
        """The prompt was prefilled on `worker` (its full blocks are cached there now)."""


class RoundRobin(Policy):
    """Each call starts one worker further along, so consecutive requests spread evenly."""

    def __init__(self) -> None:
        self._next = 0

    def order(self, candidates: list[Worker], prompt_len: int, prompt: Prompt | None = None) -> list[Worker]:
        if not candidates:
            return []
        ordered = sorted(candidates, key=lambda w: w.worker_id)  # stable across registry changes
        start = self._next % len(ordered)
        self._next += 1
        return ordered[start:] + ordered[:start]


class LeastLoaded(Policy):
    """Prefill: fewest queued prompts (last report) plus the router's own in-flight count, which is fresh."""

    def order(self, candidates: list[Worker], prompt_len: int, prompt: Prompt | None = None) -> list[Worker]:
        return sorted(candidates, key=lambda w: (queued(w), w.worker_id))


class LeastKV(Policy):
    """Decode: lowest KV block usage, counting reservations made since the last report; then fewest running."""

    def order(self, candidates: list[Worker], prompt_len: int, prompt: Prompt | None = None) -> list[Worker]:
        return sorted(candidates, key=lambda w: (w.kv_usage(), w.load.num_running + w.inflight, w.worker_id))


class CacheAware(Policy):
    """Prefill: longest cached prefix first, unless that worker is overloaded (see the module docstring)."""

    def __init__(self, block_size: int = 16, max_imbalance: int = 4) -> None:
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self._next = 0

    def order(self, candidates: list[Worker], prompt_len: int, prompt: Prompt | None = None) -> list[Worker]:
        if not candidates:
            return []
        by_id = sorted(candidates, key=lambda w: w.worker_id)
        turn = {w.worker_id: (i - self._next) % len(by_id) for i, w in enumerate(by_id)}  # rotates among equals
        self._next += 1
        matched = {w.worker_id: self.matched_blocks(w, prompt) for w in by_id}
        ordered = sorted(by_id, key=lambda w: (-matched[w.worker_id], queued(w), turn[w.worker_id]))
        if queued(ordered[0]) > min(queued(w) for w in by_id) + self.max_imbalance:
            ordered = sorted(by_id, key=lambda w: (queued(w), -matched[w.worker_id], turn[w.worker_id]))
        return ordered

    def matched_blocks(self, worker: Worker, prompt: Prompt | None) -> int:
        return matched_blocks(worker, prompt, self.block_size)

    def routed(self, worker: Worker, prompt: Prompt) -> None:
        if worker.fingerprint is not None:
            worker.prefixes.note_routed(prompt.hashes(worker.fingerprint, self.block_size))


class DecodeCacheAware(CacheAware):
    """Decode: longest cached prefix first, least_kv's order among equals and when that worker is too busy."""

    def order(self, candidates: list[Worker], prompt_len: int, prompt: Prompt | None = None) -> list[Worker]:
        by_kv = LeastKV().order(candidates, prompt_len)
        if not by_kv:
            return []
        matched = {w.worker_id: self.matched_blocks(w, prompt) for w in by_kv}
        ordered = sorted(by_kv, key=lambda w: -matched[w.worker_id])  # stable: least_kv's order among equals
        if decode_load(ordered[0]) > min(decode_load(w) for w in by_kv) + self.max_imbalance:
            return by_kv
        return ordered

    def routed(self, worker: Worker, prompt: Prompt) -> None:
        """Nothing: a decode worker names a sequence's blocks when it ends (router/decode_reuse.py notes them)."""


def matched_blocks(worker: Worker, prompt: Prompt | None, block_size: int) -> int:
    """Leading blocks of the prompt's lookup (all full blocks but one holding the last token) held there, as far
    as this router knows (router/prefix_index.py)."""
    if prompt is None or worker.fingerprint is None:
        return 0
    hashes = prompt.hashes(worker.fingerprint, block_size)
    return worker.prefixes.matched(prefix_lookup(hashes, len(prompt.token_ids), block_size))


def decode_load(worker: Worker) -> int:
    """Decode load: sequences running or waiting there (last report) plus the router's own in-flight count."""
    return worker.load.num_running + worker.load.num_waiting + worker.inflight


def queued(worker: Worker) -> int:
    """Prefill load: queued prompts (last report) plus the router's own in-flight count, which is fresh."""
    return worker.load.queue_len + worker.load.num_waiting + worker.inflight


PREFILL_POLICIES: dict[str, Callable[[PolicyOptions], Policy]] = {
    "cache_aware": lambda options: CacheAware(options.block_size, options.max_imbalance),
    "round_robin": lambda options: RoundRobin(),
    "least_loaded": lambda options: LeastLoaded(),
}
DECODE_POLICIES: dict[str, Callable[[PolicyOptions], Policy]] = {
    "least_kv": lambda options: LeastKV(),
    "cache_aware": lambda options: DecodeCacheAware(options.block_size, options.max_imbalance),
    "round_robin": lambda options: RoundRobin(),
}


def make_prefill_policy(name: str, options: PolicyOptions | None = None) -> Policy:
    return _make(PREFILL_POLICIES, name, "prefill", options)


def make_decode_policy(name: str, options: PolicyOptions | None = None) -> Policy:
    return _make(DECODE_POLICIES, name, "decode", options)


def _make(table: dict[str, Callable[[PolicyOptions], Policy]], name: str, role: str,
          options: PolicyOptions | None) -> Policy:
    if name not in table:
        raise ValueError(f"unknown {role} policy {name!r}; choose one of {sorted(table)}")
    return table[name](options or PolicyOptions())
