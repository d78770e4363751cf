"""Block-hash events with sequence numbers: how several routers keep one view of what a worker caches.

A worker tells every router it knows about the prefix blocks it holds (device or host RAM, the keys of
protocol/prefix_summary.py). Sending the whole summary on every heartbeat to every router costs up to 44 KiB a
second per pair; sending only the changes needs an order, so each change carries a sequence number, as
vLLM's KV events do (BlockStored / BlockRemoved on a publisher, a replay endpoint for a subscriber that
missed some):

    worker   PrefixEventLog.observe(held keys)  ─▶ PrefixEvent(seq n, stored, removed), kept in a bounded ring
             PrefixPublisher, per router: events after the seq that router last acknowledged; a PrefixSnapshot
             (epoch, seq, all keys) when that router knows nothing yet, asked for one, or fell behind the ring
    router   PrefixReplica: snapshot ─▶ apply events in order; an event after a gap (or of another epoch: the
             worker restarted) is not applied, and the router asks for a snapshot in its heartbeat answer

The epoch names one run of the worker's log (a restarted worker counts from 1 again). Replaying the events
from a snapshot yields exactly the key set the worker observed last: the routers converge on it.

Wire form (JSON, keys as base64 of their concatenation):

    "prefix_events":   {"epoch": "3f9c…", "events": [{"seq": 7, "stored": "<b64>", "removed": "<b64>"}, ...]}
    "prefix_snapshot": {"epoch": "3f9c…", "seq": 7, "keys": "<b64>"}
    heartbeat answer:  {"prefix": {"epoch": "3f9c…", "seq": 7}}    or    {"prefix": {"resync": true}}

Torch-free: the router imports it.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pdserve.protocol.prefix_summary import KEY_BYTES, decode_summary

DEFAULT_EVENT_CAPACITY = 256  # events kept for routers that are behind; older ones get a snapshot


@dataclass(frozen=True)
class PrefixEvent:
    seq: int
    stored: frozenset[bytes]
    removed: frozenset[bytes]

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "stored": _encode(self.stored), "removed": _encode(self.removed)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefixEvent:
        seq = data.get("seq")
        if not isinstance(seq, int) or seq < 1:
            raise ValueError(f"an event's seq must be an integer >= 1, got {seq!r}")
        return cls(seq, decode_summary(str(data.get("stored", ""))), decode_summary(str(data.get("removed", ""))))


@dataclass(frozen=True)
class PrefixSnapshot:
    epoch: str
    seq: int  # the last event folded into `keys` (0: none yet)
    keys: frozenset[bytes]

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seq": self.seq, "keys": _encode(self.keys)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefixSnapshot:
        epoch, seq = data.get("epoch"), data.get("seq")
        if not isinstance(epoch, str) or not epoch:
            raise ValueError(f"a snapshot needs its epoch, got {epoch!r}")
        if not isinstance(seq, int) or seq < 0:
            raise ValueError(f"a snapshot's seq must be an integer >= 0, got {seq!r}")
        return cls(epoch, seq, decode_summary(str(data.get("keys", ""))))


def decode_events(data: dict[str, Any]) -> tuple[str, list[PrefixEvent]]:
    """`prefix_events` → (epoch, events in the order sent); ValueError for a malformed body."""
    epoch, events = data.get("epoch"), data.get("events")
    if not isinstance(epoch, str) or not epoch or not isinstance(events, list):
        raise ValueError(f"expected {{'epoch': str, 'events': [...]}}, got keys {sorted(data)}")
    return epoch, [PrefixEvent.from_dict(event) for event in events]


def encode_events(epoch: str, events: list[PrefixEvent]) -> dict[str, Any]:
    return {"epoch": epoch, "events": [event.to_dict() for event in events]}


class PrefixEventLog:
    """The worker's side: successive observations of its held keys, as numbered events (not thread-safe:
    the worker's event loop calls it)."""

    def __init__(self, capacity: int = DEFAULT_EVENT_CAPACITY, epoch: str | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.epoch = epoch or uuid.uuid4().hex[:16]
        self.seq = 0
        self.keys: frozenset[bytes] = frozenset()
        self._events: deque[PrefixEvent] = deque(maxlen=capacity)

    def observe(self, keys: Iterable[bytes]) -> PrefixEvent | None:
        """The keys held now; an event when they differ from the last observation."""
        current = frozenset(keys)
        if current == self.keys:
            return None
        self.seq += 1
        event = PrefixEvent(self.seq, current - self.keys, self.keys - current)
        self.keys = current
        self._events.append(event)
        return event

    def since(self, seq: int) -> list[PrefixEvent] | None:
        """The events after `seq`, oldest first; None when some of them are no longer kept (or `seq` is
        ahead of this log: it belongs to another epoch): send a snapshot then."""
        if seq > self.seq:
            return None
        if seq == self.seq:
            return []
        if not self._events or self._events[0].seq > seq + 1:
            return None
        return [event for event in self._events if event.seq > seq]

    def snapshot(self) -> PrefixSnapshot:
        return PrefixSnapshot(self.epoch, self.seq, self.keys)


class PrefixReplica:
    """The router's side for one worker: the keys it holds as far as the events received tell."""

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.seq: int | None = None  # None: no snapshot yet (or the last one is void): events cannot apply
        self.keys: set[bytes] = set()

    @property
    def in_step(self) -> bool:
        return self.seq is not None

    def load(self, snapshot: PrefixSnapshot) -> None:
        self.epoch, self.seq, self.keys = snapshot.epoch, snapshot.seq, set(snapshot.keys)

    def apply(self, epoch: str, events: list[PrefixEvent]) -> bool:
        """Apply what follows our seq, in order; False (and out of step until the next snapshot) on a gap or
        another epoch. Events already applied are skipped: a heartbeat answer that was lost makes the worker
        send them again."""
        if epoch != self.epoch or self.seq is None:
            self.seq = None
            return False
        for event in events:
            if event.seq <= self.seq:
                continue
            if event.seq != self.seq + 1:
                self.seq = None  # the keys stay (stale beats empty for routing) until the snapshot comes
                return False
            self.keys -= event.removed
            self.keys |= event.stored
            self.seq = event.seq
        return True

    def answer(self) -> dict[str, Any]:
        """What the heartbeat answer says about this replica (the worker acknowledges or resyncs by it)."""
        if self.seq is None:
            return {"resync": True}
        return {"epoch": self.epoch, "seq": self.seq}


def _encode(keys: Iterable[bytes]) -> str:
    raw = b"".join(sorted(keys))
    assert len(raw) % KEY_BYTES == 0, "prefix keys are summary keys"
    return base64.b64encode(raw).decode("ascii")


class PrefixPublisher:
    """The prefix part of each router's heartbeats (worker/router_links.py): the held keys are observed at most
    every `min_interval_s` (one pass over up to 8,192 recent hashes, shared by the links to all routers), and
    each router gets what it lacks after the (epoch, seq) it acknowledged."""

    def __init__(self, held_keys: Callable[[], Iterable[bytes]], min_interval_s: float = 0.5,
                 log: PrefixEventLog | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.held_keys = held_keys
        self.log = log or PrefixEventLog()
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._observed_at: float | None = None

    def refresh(self) -> None:
        now = self._clock()
        if self._observed_at is None or now - self._observed_at >= self._min_interval_s:
            self.log.observe(self.held_keys())
            self._observed_at = now

    def fields(self, acked: tuple[str, int] | None) -> dict[str, Any]:
        """`prefix_events` after `acked`, nothing when there is none, or a `prefix_snapshot`."""
        self.refresh()
        if acked is not None and acked[0] == self.log.epoch:
            events = self.log.since(acked[1])
            if events is not None:
                return {"prefix_events": encode_events(self.log.epoch, events)} if events else {}
        return {"prefix_snapshot": self.log.snapshot().to_dict()}

    def acknowledged(self, answer: Any) -> tuple[str, int] | None:
        """A heartbeat answer's `prefix` → what that router holds now (None: it needs a snapshot)."""
        if isinstance(answer, dict) and answer.get("epoch") == self.log.epoch and isinstance(answer.get("seq"), int):
            return self.log.epoch, answer["seq"]
        return None
