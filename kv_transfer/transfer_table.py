"""The receiver's table of expected transfers: what may arrive, what did, and each lease.

    expect ──▶ PENDING ──(every layer × every block recorded, then done)──▶ on_complete ─┐
                  │   ──(lease expires / bad frame / connection lost / sender error)──▶ on_failure ─┤─▶ gone
                  ├──(cancel: the node gave up itself)──────────────────────────────────────────────┤
                  └──(drain: the node gave up, but the sender may still be writing into the pool)    │
                        ──▶ DRAINING ──(its done / error / connection lost / the lease)──▶ on_released┘

DRAINING is for backends whose sender writes into the receiver's pool itself (cuda_ipc): the reserved blocks
must not be reused while its copies may still land (issue 16: SGLang's deferred release). Frames for a
draining request write nothing; the end of the sender's part, or its silence for a lease, releases them.

The lease is renewed by every recorded layer: it expires once no KV arrived for `lease_s` (the time from
`expect` to its deadline), so a long prompt that streams steadily never expires, while a sender that stalls
or vanishes mid-transfer is given up `lease_s` after its last frame. Before the first frame the lease also
counts the sender's queueing time. Renewal only stamps the time (`record_layer` may run on a compute
thread, for the `local` backend); the timer on the loop re-arms itself for the remainder when it fires early.

The last `MAX_ENDED` ended request ids are remembered, so that frames still in flight for them can be
told apart from frames for ids that were never expected (a protocol violation).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

MAX_ENDED = 4096


@dataclass
class _Pending:
    block_ids: frozenset[int]
    num_tokens: int | None
    received: list[set[int]]  # per layer
    lease: asyncio.TimerHandle | None = field(default=None)
    lease_s: float = 0.0  # longest silence allowed (0: no lease)
    last_progress: float = 0.0  # time.monotonic() of `expect` or of the last recorded layer

    def missing(self) -> str | None:
        for layer, got in enumerate(self.received):
            if got != self.block_ids:
                return f"layer {layer} lacks blocks {sorted(self.block_ids - got)[:8]}"
        return None


class TransferTable:
    def __init__(
        self,
        num_layers: int,
        block_size: int,
        on_complete: Callable[[str, int, float | None, list[tuple[int, float]]], None],
        on_failure: Callable[[str, str], None],
    ) -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self._on_complete = on_complete
        self._on_failure = on_failure
        self._pending: dict[str, _Pending] = {}
        self._draining: dict[str, tuple[Callable[[str], None], asyncio.TimerHandle | None]] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._pending

    def expect(
        self, request_id: str, block_ids: Sequence[int], deadline: float | None, num_tokens: int | None
    ) -> None:
        if request_id in self._pending:
            raise ValueError(f"request {request_id!r} already has a pending transfer")
        blocks = frozenset(block_ids)
        if len(blocks) != len(block_ids) or not blocks:
            raise ValueError(f"reserved block ids must be distinct and non-empty, got {list(block_ids)[:16]}")
        if num_tokens is not None and not 0 < num_tokens <= len(blocks) * self.block_size:
            raise ValueError(f"{num_tokens} tokens do not fit {len(blocks)} blocks of {self.block_size}")
        self._ended.pop(request_id, None)
        pending = _Pending(blocks, num_tokens, [set() for _ in range(self.num_layers)])
        if deadline is not None:
            now = time.monotonic()
            pending.lease_s, pending.last_progress = max(0.0, deadline - now), now
            pending.lease = asyncio.get_running_loop().call_later(pending.lease_s, self._expire, request_id)
        self._pending[request_id] = pending

    def recently_ended(self, request_id: str) -> bool:
        return request_id in self._ended or request_id in self._draining

    def drain(self, request_id: str, on_released: Callable[[str], None]) -> bool:
        """Stop expecting the request's KV, but call `on_released` only once the sender's part ended (its
        done or error frame, its connection lost) or it stayed silent for the request's lease. False when the
        request was not pending (nothing to wait for: the caller releases at once)."""
        pending = self._pending.get(request_id)
        if pending is None:
            return False
        lease_s = pending.lease_s
        self._forget(request_id)
        timer = None
        if lease_s > 0:
            timer = asyncio.get_running_loop().call_later(lease_s, self.release, request_id)
        self._draining[request_id] = (on_released, timer)
        return True

    def release(self, request_id: str) -> bool:
        """The sender's part of a draining request ended: release its blocks (False: not draining)."""
        entry = self._draining.pop(request_id, None)
        if entry is None:
            return False
        on_released, timer = entry
        if timer is not None:
            timer.cancel()
        _call(on_released, request_id)
        return True

    @property
    def num_draining(self) -> int:
        return len(self._draining)

    def check_layer(self, request_id: str, layer: int, block_ids: Sequence[int]) -> str | None:
        """Why blocks of `layer` may not be written for this request, or None when they may."""
        pending = self._pending.get(request_id)
        if pending is None:
            return f"unknown request id {request_id!r}"
        if not 0 <= layer < self.num_layers:
            return f"layer {layer} outside 0..{self.num_layers - 1}"
        if not block_ids or len(set(block_ids)) != len(block_ids):
            return f"block ids must be distinct and non-empty, got {list(block_ids)[:16]}"
        strays = set(block_ids) - pending.block_ids
        if strays:
            return f"blocks {sorted(strays)[:8]} are not reserved for {request_id!r}"
        return None

    def record_layer(self, request_id: str, layer: int, block_ids: Sequence[int]) -> None:
        pending = self._pending[request_id]
        pending.received[layer].update(block_ids)
        pending.last_progress = time.monotonic()  # renews the lease

    def record_all(self, request_id: str) -> None:
        """Every layer of every reserved block arrived (cuda_ipc: the sender wrote them into the pool itself and
        says so with its "done")."""
        pending = self._pending[request_id]
        for received in pending.received:
            received.update(pending.block_ids)
        pending.last_progress = time.monotonic()

    def complete(self, request_id: str, first_token_id: int, first_logprob: float | None, num_tokens: int,
                 first_top: Sequence[tuple[int, float]] = ()) -> bool:
        """Finish on the sender's "done": on_complete if everything arrived, otherwise on_failure."""
        if self.release(request_id):  # drained: the sender finished writing what it wrote
            return True
        pending = self._pending.get(request_id)
        if pending is None:
            return False
        problem = pending.missing()
        if problem is None and pending.num_tokens not in (None, num_tokens):
            problem = f"done says {num_tokens} tokens, {pending.num_tokens} were reserved"
        if problem is None and not 0 < num_tokens <= len(pending.block_ids) * self.block_size:
            problem = f"done says {num_tokens} tokens for {len(pending.block_ids)} blocks of {self.block_size}"
        if problem is not None:
            return self.fail(request_id, f"done before the KV was complete: {problem}")
        self._forget(request_id)
        _call(self._on_complete, request_id, first_token_id, first_logprob, list(first_top))
        return True

    def fail(self, request_id: str, reason: str) -> bool:
        if self.release(request_id):  # a drained request's sender gave up or its connection dropped
            return True
        if request_id not in self._pending:
            return False
        self._forget(request_id)
        logger.warning("KV transfer %s failed: %s", request_id, reason)
        _call(self._on_failure, request_id, reason)
        return True

    def cancel(self, request_id: str) -> bool:
        if request_id not in self._pending:
            return False
        self._forget(request_id)
        return True

    def fail_all(self, reason: str) -> None:
        for request_id in [*self._pending, *self._draining]:
            self.fail(request_id, reason)

    def _expire(self, request_id: str) -> None:
        pending = self._pending.get(request_id)
        if pending is None:
            return
        silent_s = time.monotonic() - pending.last_progress
        if silent_s < pending.lease_s:  # KV arrived since the timer was set: wait for the rest of the lease
            pending.lease = asyncio.get_running_loop().call_later(pending.lease_s - silent_s, self._expire, request_id)
            return
        self.fail(request_id, f"lease of {pending.lease_s:.3f} s expired ({pending.missing() or 'done missing'}), "
                              f"no KV for {silent_s:.3f} s")

    def _forget(self, request_id: str) -> None:
        pending = self._pending.pop(request_id)
        if pending.lease is not None:
            pending.lease.cancel()
        self._ended[request_id] = None
        if len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)


def _call(callback: Callable[..., None], *args: object) -> None:
    """A callback's exception must not break the connection that delivered other requests' KV."""
    try:
        callback(*args)
    except Exception:
        logger.exception("KV transfer callback %r raised for %r", callback, args[0])
