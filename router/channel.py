"""One sub-request's traffic on its two links, and the sink that gathers a response's deltas.

    Channel (per attempt)                                         DeltaSink (per response)
    ─────────────────────                                         ────────────────────────
    D: RESERVED / REFUSED ─▶ reserve_answer (a future)
    P: PREFILLED ─────────▶ the first token, unless D's came first ─┐
    D: TOKENS delta ──────▶ D's first token is dropped when P's came ├─▶ pending (position, delta) ─▶ the writer
                            first (the same token, the same text)    │   wakes once for every batch of them
    P: PREFILL_FAILED, D's error before the first token,             │
       a link lost ──────▶ `failure` (the relay retries on other workers while nothing reached the client)
                            after the first token: a failed delta in the sink (the client gets an error event)

The first token is the first of P's PREFILLED and D's first delta: P samples it and sends it to the router and
(with the KV's "done" frame) to D at once; both compute its text with engine/output.py, so they agree to the
character, and whichever arrives first is relayed. (Should D's KV load fail after P's token went out, D's
recompute samples the same token when sampling is greedy or seeded; unseeded sampling may differ then.) A request
D prefills itself (RESERVED local_prefill) has no P at all: `prefill_link` stays None, the first token is D's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.protocol.messages import (
    Abort,
    Message,
    Prefilled,
    PrefillFailed,
    Refused,
    Reserved,
    TokenDelta,
)
from pdserve.router.plan import SubRequest
from pdserve.router.registry import Worker
from pdserve.router.worker_link import LinkDown, WorkerLink

LAST_DELTA_WAIT_S = 1.0  # longest a finished response waits for P's numbers (Channel._hold_last)


class WorkerFailed(Exception):
    """A worker could not do its part (refused, failed, link lost); the message names it.

    `role` says whose part failed: a failed prefill worker is not tried again for the request, a failed decode
    worker is (the registry learns it is gone). `reason` labels `pdserve_retries`."""

    def __init__(self, message: str, role: str = "prefill", reason: str = "prefill_failed") -> None:
        super().__init__(message)
        self.role = role
        self.reason = reason


@dataclass(frozen=True)
class PrefillNumbers:
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    prefill_s: float = 0.0


class DeltaSink:
    """Where a response's channels put their deltas; `take` waits until there is at least one."""

    __slots__ = ("_waiter", "pending")

    def __init__(self) -> None:
        self.pending: list[tuple[int, TokenDelta | WorkerFailed]] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, position: int, item: TokenDelta | WorkerFailed) -> None:
        self.pending.append((position, item))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[tuple[int, TokenDelta | WorkerFailed]]:
        while not self.pending:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self.pending = self.pending, []
        return items


class Channel:
    def __init__(self, sub: SubRequest, request_id: str, position: int, sink: DeltaSink,
                 prefill: WorkerLink | None = None,
                 on_prefilled: Callable[[PrefillNumbers], None] = lambda numbers: None,
                 on_finished: Callable[[Channel, str], None] = lambda channel, finish_reason: None) -> None:
        self.sub = sub
        self._on_prefilled_numbers = on_prefilled
        self._on_finished = on_finished  # D sent the last delta (its finish reason): what it holds now changed
        self.request_id = request_id
        self.position = position
        self.sink = sink
        self.prefill_link: WorkerLink | None = None
        if prefill is not None:
            self.use_prefill(prefill)
        self.decode_link: WorkerLink | None = None
        self.output_token_ids: list[int] = []  # every token relayed, in order (P's first one included)
        loop = asyncio.get_running_loop()
        self.reserve_answer: asyncio.Future[Reserved | Refused] = loop.create_future()
        self.started: asyncio.Future[None] = loop.create_future()  # first token relayed, or a failure
        self.prefill_lost: asyncio.Future[str] = loop.create_future()  # P's link dropped before the first token
        self.prefill_numbers: PrefillNumbers | None = None  # P's answer, once it came
        self.prefill_answered = False
        self.first_from: str | None = None  # "prefill" | "decode"
        self._decode_tokens_seen = False
        # P's, when the request asked (router/responses.py shows them)
        self.prompt_logprobs: list[dict[str, Any] | None] | None = None
        self._held: list[TokenDelta] = []  # D's deltas waiting for P's answer (prompt logprobs come only from P)
        self._last_held: TokenDelta | None = None  # D's last delta, waiting for P's numbers (cached tokens)
        self._last_timer: asyncio.TimerHandle | None = None
        self.finished = False  # the client has the last delta (or an error)
        self.decode_finished = False  # D sent its last delta: nothing to abort there
        self.decode_counted = False  # the relay counted this channel in the decode worker's `inflight`
        self.target_sent = False  # P has D's transfer target: its copies may be on their way to D's blocks
        self.through_store = False  # the target is the `store` backend's: P's KV may outlive P there

    @property
    def decode(self) -> Worker:
        assert self.decode_link is not None
        return self.decode_link.worker

    @property
    def prefill(self) -> Worker:
        assert self.prefill_link is not None
        return self.prefill_link.worker

    def use_prefill(self, link: WorkerLink) -> None:
        """`link`'s worker prefills the request (its answers come here); counted in its `inflight`."""
        self.prefill_link = link
        link.subscribe(self.request_id, self)
        link.worker.inflight += 1
        link.worker.inflight_prompt_tokens += len(self.sub.prompt_token_ids)

    def prefill_done(self) -> None:
        """The attempt is over, whatever came of it: the prefill worker no longer counts it as in flight."""
        if self.prefill_link is not None:
            self.prefill.inflight -= 1
            self.prefill.inflight_prompt_tokens -= len(self.sub.prompt_token_ids)

    def use_decode(self, link: WorkerLink) -> None:
        """Ask `link`'s worker for the reservation next (a fresh answer future)."""
        self.decode_link = link
        self.reserve_answer = asyncio.get_running_loop().create_future()
        link.subscribe(self.request_id, self)

    def leave_decode(self, abort: bool = False) -> None:
        """That decode worker will not hold the request (refused, silent, lost)."""
        link, self.decode_link = self.decode_link, None
        if link is None:
            return
        if link is not self.prefill_link:
            link.unsubscribe(self.request_id)
        if abort and link.up:
            with contextlib.suppress(LinkDown):
                link.send(Abort(self.request_id, "no answer to the reservation in time", sender_may_write=False))

    # ---- from the links -------------------------------------------------------------------------

    def on_message(self, link: WorkerLink, message: Message) -> None:
        if isinstance(message, Reserved | Refused):
            if link is self.decode_link and not self.reserve_answer.done():
                self.reserve_answer.set_result(message)
        elif isinstance(message, Prefilled):
            self._on_prefilled(message)
        elif isinstance(message, PrefillFailed):
            self.prefill_answered = True
            if self._last_held is not None:  # D finished with P's KV already: P's late failure changes nothing
                self._release_last()
            elif message.status == 400:
                self._fail(WorkerFailed(f"prefill worker refused the request: {message.message}", "client",
                                        "bad_request"))
            else:
                self._fail(WorkerFailed(f"{self.prefill.worker_id} answered {message.status}: {message.message}"))

    def _on_prefilled(self, message: Prefilled) -> None:
        self.prefill_answered = True
        self.prefill_numbers = PrefillNumbers(message.num_cached_tokens, message.num_computed_tokens,
                                              message.prefill_s)
        self._on_prefilled_numbers(self.prefill_numbers)
        if self.first_from is not None:
            self._release_last()
            return
        self.first_from = "prefill"
        self.prompt_logprobs = message.prompt_logprobs
        prompt = len(self.sub.prompt_token_ids)
        self._relay(TokenDelta(self.request_id, [message.first_token_id], message.text, message.finish_reason,
                               message.logprobs, prompt, 1, message.num_cached_tokens))
        held, self._held = self._held, []
        for delta in held:  # D's, which came first: its copy of the first token is dropped as usual
            if self.decode_link is not None:
                self.on_delta(self.decode_link, delta)

    def on_delta(self, link: WorkerLink, delta: TokenDelta) -> None:
        if link is not self.decode_link or self.finished:
            return
        if delta.finish_reason is not None:
            self.decode_finished = True
        if delta.failed and self.first_from is None:
            self._fail(WorkerFailed(f"decode worker {self.decode.worker_id} ended {self.request_id} before its "
                                    f"first token ({delta.finish_reason}: {delta.error})", "prefill", "kv_failed"))
            return
        if self.first_from is None and self.sub.needs_prefill_answer:
            self._held.append(delta)
            return
        if delta.token_ids and not self._decode_tokens_seen:
            self._decode_tokens_seen = True
            if self.first_from == "prefill":  # P's copy of this token went out already
                if delta.finish_reason is None:
                    return
                delta = TokenDelta(delta.request_id, [], "", delta.finish_reason, None, delta.prompt_tokens,
                                   delta.completion_tokens, delta.cached_tokens, delta.error)
            else:
                self.first_from = "decode"
        if delta.finish_reason is not None and not self.prefill_answered:
            self._hold_last(delta)
            return
        self._relay(delta)

    def _hold_last(self, delta: TokenDelta) -> None:
        """D's last delta came before P's PREFILLED (a short completion: D ends a step after the KV landed): the
        usage it closes needs P's numbers (the prompt tokens P found cached; D, which got them as KV, cannot
        tell), and P sends them as it sends the KV's last frame, so they are due at once. Wait for them, at
        most LAST_DELTA_WAIT_S (a P lost meanwhile releases it too)."""
        self._last_held = delta
        self._last_timer = asyncio.get_running_loop().call_later(LAST_DELTA_WAIT_S, self._release_last)

    def _release_last(self) -> None:
        delta, self._last_held = self._last_held, None
        if self._last_timer is not None:
            self._last_timer.cancel()
            self._last_timer = None
        if delta is None or self.finished:
            return
        numbers = self.prefill_numbers
        if numbers is not None and numbers.num_cached_tokens > delta.cached_tokens:
            delta = TokenDelta(delta.request_id, delta.token_ids, delta.text, delta.finish_reason, delta.logprobs,
                               delta.prompt_tokens, delta.completion_tokens, numbers.num_cached_tokens,
                               delta.error)
        self._relay(delta)

    def on_link_lost(self, link: WorkerLink, reason: str) -> None:
        if self.finished:
            return
        if link is self.decode_link:
            self.decode_finished = True  # nothing left there to abort
            if not self.reserve_answer.done():
                self.reserve_answer.set_exception(WorkerFailed(
                    f"decode worker {link.worker_id} lost: {reason}", "decode", "decode_failed"))
                return
            self._fail(WorkerFailed(f"decode worker {link.worker_id} lost: {reason}", "decode", "decode_failed"))
        elif link is self.prefill_link and self.first_from is None:
            # not a failure yet: D still holds the reservation, and its KV lease ends in a recompute (or an
            # error delta); the relay retries on another P now if there is one (router/relay.py)
            self.prefill_answered = True
            if not self.prefill_lost.done():
                self.prefill_lost.set_result(f"prefill worker {link.worker_id} lost: {reason}")
        elif link is self.prefill_link:
            self.prefill_answered = True
            self._release_last()

    # ---- to the response ------------------------------------------------------------------------

    def _relay(self, delta: TokenDelta) -> None:
        self.output_token_ids += delta.token_ids
        if delta.finish_reason is not None:
            self.finished = True
            if self.decode_link is not None:
                self._on_finished(self, delta.finish_reason)
        self.sink.put(self.position, delta)
        if not self.started.done():
            self.started.set_result(None)

    def _fail(self, failure: WorkerFailed) -> None:
        if not self.started.done():
            self.started.set_exception(failure)  # the relay retries, or answers with an error status
            self.started.exception()  # retrieved: a channel given up on must not log "never retrieved"
            return
        if not self.finished:
            self.finished = True
            self.sink.put(self.position, failure)

    # ---- closing --------------------------------------------------------------------------------

    def close(self, reason: str) -> None:
        """Leave both links; abort wherever work may still be held (no waiting: the sends are queued)."""
        self.finished = True
        if self.decode_counted and self.decode_link is not None:
            self.decode_counted = False
            self.decode.inflight -= 1
        for link, busy in ((self.prefill_link, not self.prefill_answered),
                           (self.decode_link, not self.decode_finished)):
            if link is None:
                continue
            link.unsubscribe(self.request_id)
            if busy and link.up:
                with contextlib.suppress(LinkDown):
                    link.send(Abort(self.request_id, reason, sender_may_write=self.target_sent))
