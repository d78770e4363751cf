"""The life of one sub-request against the workers, over their data-plane links (router/worker_link.py):

    pick P ─▶ PREFILL (no target yet) to P ─┐ dispatched together: P looks its prefix up meanwhile
           └▶ RESERVE to the best D ────────┘
                 │ REFUSED 503 / no answer in --reserve-timeout / link down: next D (a D that did not answer
                 │ is marked unreachable until it heartbeats, and gets an ABORT, queued, never waited for);
                 │ none left: ABORT to P, 503
                 ▼ RESERVED
              PREFILL_TARGET to P ─▶ the first token, from P's PREFILLED or D's first delta, whichever
                                     comes first (router/channel.py) ─▶ the channel is started
                 failed before it (P failed, D's KV load failed, D lost): ABORT to both, then once more with
                 another P (the same P again when D was what failed), else 503. P's link lost: the same when
                 another P is up; else D's KV lease decides (it recomputes the prompt, or fails the request).
                 With the `store` backend, P's KV may have landed in the store before P went: D is sent
                 SENDER_LOST and decides at once (its first delta if the KV landed; else a recompute, or an
                 error that is retried as above)

Conditional disaggregation (router/decode_reuse.py): when a decode worker holds so much of the prompt that
fewer than --local-prefill-threshold tokens are left, that D is asked first, alone, with RESERVE.max_local_prefill:

    RESERVE (max_local_prefill) to that D ─▶ RESERVED local_prefill ─▶ D's first delta is the first token; no P
                                          └▶ RESERVED (D held less by now) ─▶ PREFILL with D's target to a P
                                             (the fallback: P's lookup no longer overlaps the reservation)

A started channel relays D's deltas into the response's sink until the last one; closing it early (the client
left, another choice failed) sends ABORT to D (and to P if P had not answered), which frees the blocks. A
sequence that ends with stop or length leaves its blocks named on its D: the router notes them there at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pdserve.protocol.messages import Prefill, PrefillTarget, Refused, Reserve, Reserved, SenderLost
from pdserve.router.channel import Channel, DeltaSink, WorkerFailed
from pdserve.router.config import RouterConfig
from pdserve.router.decode_reuse import DecodeReuse
from pdserve.router.errors import APIError, service_unavailable
from pdserve.router.metrics import RouterMetrics
from pdserve.router.plan import SubRequest
from pdserve.router.policies import Policy, Prompt
from pdserve.router.registry import Worker, WorkerRegistry
from pdserve.router.worker_link import LinkDown, WorkerLink, WorkerLinks

log = logging.getLogger(__name__)
_ATTEMPTS = 2  # the first try, then one more (with another P when P failed)


def upstream_error(message: str) -> APIError:
    return APIError(502, message, type="server_error", code="worker_failed")


class Relay:
    def __init__(self, links: WorkerLinks, registry: WorkerRegistry, prefill_policy: Policy,
                 decode_policy: Policy, config: RouterConfig, metrics: RouterMetrics) -> None:
        self._links = links
        self._registry = registry
        self._prefill_policy = prefill_policy
        self._decode_policy = decode_policy
        self._config = config
        self._metrics = metrics
        self._reuse = DecodeReuse(config.block_size, config.local_prefill_threshold, config.cache_aware_max_imbalance,
                                  config.busy_local_prefill_tokens, config.busy_prefill_backlog)

    def set_policies(self, prefill: Policy, decode: Policy) -> None:
        """Swap the policies (admin API); sub-requests already started keep the workers they were given."""
        self._prefill_policy = prefill
        self._decode_policy = decode

    async def start_all(self, subs: list[SubRequest], sink: DeltaSink) -> list[Channel]:
        """Start every sub-request; all or none (the started ones are closed when one fails)."""
        if len(subs) == 1:
            return [await self.start(subs[0], 0, sink)]
        tasks = [asyncio.create_task(self.start(sub, i, sink)) for i, sub in enumerate(subs)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
            if failed or not all(t.done() for t in tasks):
                for task in tasks:
                    task.cancel()
                results = await asyncio.gather(*tasks, return_exceptions=True)
                for result in results:
                    if isinstance(result, Channel):
                        result.close("another choice of the request failed")
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
        return [t.result() for t in tasks]

    async def start(self, sub: SubRequest, position: int, sink: DeltaSink) -> Channel:
        failed: dict[str, str] = {}  # prefill worker id -> why
        reasons: list[str] = []
        prompt = Prompt(sub.prompt_token_ids, sub.cache_salt)
        for attempt in range(_ATTEMPTS):
            request_id = sub.request_id if attempt == 0 else f"{sub.request_id}-retry{attempt}"
            channel = Channel(sub, request_id, position, sink,
                              on_prefilled=lambda numbers: self._metrics.prefill.observe(numbers.prefill_s),
                              on_finished=self._decode_finished)
            try:
                return await self._attempt(channel, prompt, failed)
            except WorkerFailed as exc:
                log.warning("attempt %d of %s failed: %s", attempt + 1, sub.request_id, exc)
                self._metrics.retries.labels(exc.reason).inc()
                reasons.append(str(exc))
                if exc.role == "prefill" and channel.prefill_link is not None:
                    failed[channel.prefill.worker_id] = str(exc)
        raise service_unavailable(f"failed on {len(reasons)} attempts: {'; '.join(reasons)}",
                                  self._config.retry_after_s)

    async def _attempt(self, channel: Channel, prompt: Prompt, failed: dict[str, str]) -> Channel:
        decode_candidates = self._registry.candidates("decode")
        local = self._reuse.local_choice(decode_candidates, channel.sub, prompt)
        busy = False
        if local is None:
            prefill_candidates = [w for w in self._registry.candidates("prefill") if w.worker_id not in failed]
            registered = sum("prefill" in w.roles for w in self._registry.workers())
            local = self._reuse.busy_choice(prefill_candidates, registered, decode_candidates, channel.sub, prompt)
            busy = local is not None
        try:
            if local is None:
                await self._prefill_on(channel, prompt, failed, None)
            else:
                reserved = await self._reserve(channel, prompt, local, busy)
                if reserved.local_prefill:
                    self._metrics.local_prefills.inc()
                    if busy:
                        self._metrics.busy_local_prefills.inc()
                else:  # D holds less than its last report said: a P computes the rest, into D's new blocks
                    self._metrics.local_prefill_fallbacks.inc()
                    await self._prefill_on(channel, prompt, failed, reserved)
            await self._first_token(channel)
        except LinkDown as exc:
            channel.close("the attempt failed")
            raise WorkerFailed(str(exc)) from exc
        except BaseException:
            channel.close("the attempt failed")
            raise
        finally:
            channel.prefill_done()
        return channel

    async def _prefill_on(self, channel: Channel, prompt: Prompt, failed: dict[str, str],
                          reserved: Reserved | None) -> None:
        """Hand the prompt to a P: PREFILL and RESERVE together (P looks its prefix up while D reserves), then
        D's target; or, when D has reserved already, PREFILL with the target in it."""
        prefill = self._pick_prefill(prompt, failed)
        try:
            channel.use_prefill(await self._ready(prefill, "prefill"))
        except WorkerFailed as exc:
            failed[prefill.worker_id] = str(exc)
            raise
        sub, request_id, link = channel.sub, channel.request_id, channel.prefill_link
        assert link is not None  # use_prefill set it
        if reserved is None:
            link.send(Prefill(request_id, sub.prompt_token_ids, sub.sampling.to_dict(), sub.cache_salt))
            reserved = await self._reserve(channel, prompt)
            link.send(PrefillTarget(request_id, reserved.transfer))
        else:
            link.send(Prefill(request_id, sub.prompt_token_ids, sub.sampling.to_dict(), sub.cache_salt,
                              reserved.transfer))
        channel.target_sent = True
        channel.through_store = reserved.transfer.get("backend") == "store"

    def _decode_finished(self, channel: Channel, finish_reason: str) -> None:
        self._reuse.finished(channel.decode, channel.sub, channel.output_token_ids, finish_reason)

    async def _first_token(self, channel: Channel) -> None:
        try:
            async with asyncio.timeout(self._config.prefill_timeout_s):
                waiting: set[asyncio.Future[Any]] = {channel.started, channel.prefill_lost}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if not channel.started.done():
                    self._prefill_lost(channel, channel.prefill_lost.result())
                await asyncio.shield(channel.started)
        except TimeoutError:
            prefill = channel.prefill.worker_id if channel.prefill_link is not None else "no prefill worker"
            raise WorkerFailed(f"no first token for {channel.request_id} from {prefill} or "
                               f"{channel.decode.worker_id} within {self._config.prefill_timeout_s:g} s",
                               "prefill", "prefill_timeout") from None
        except WorkerFailed as exc:
            if exc.role == "client":
                raise APIError(400, str(exc)) from exc
            raise

    def _prefill_lost(self, channel: Channel, lost: str) -> None:
        """P's link went before the first token: retry now (WorkerFailed), or let D finish or fail it."""
        if channel.sub.needs_prefill_answer:  # D cannot recompute P's prompt logprobs
            raise WorkerFailed(lost)
        if channel.through_store and channel.decode_link is not None:
            try:  # its KV may be in the store already: D completes the request, or fails it at once
                channel.decode_link.send(SenderLost(channel.request_id, lost))
                return
            except LinkDown:
                raise WorkerFailed(lost) from None
        if [w for w in self._registry.candidates("prefill") if w is not channel.prefill]:
            raise WorkerFailed(lost)
        log.warning("%s: %s and no other prefill worker is up; waiting for the decode worker's KV lease "
                    "(recompute or error)", channel.request_id, lost)

    async def _ready(self, worker: Worker, role: str) -> WorkerLink:
        try:
            link = self._links.get(worker)
            await link.ready()
        except LinkDown as exc:
            raise WorkerFailed(str(exc), role, f"{role}_failed") from exc
        return link

    def _pick_prefill(self, prompt: Prompt, failed: dict[str, str]) -> Worker:
        """The policy's first choice; it is told at once, so the next request with this prefix can follow it
        there before the worker's next heartbeat says what it holds."""
        available = self._registry.candidates("prefill")
        policy = self._prefill_policy
        ordered = policy.order([w for w in available if w.worker_id not in failed], len(prompt.token_ids), prompt)
        if not ordered:
            why = "; ".join(failed.values())
            raise service_unavailable(f"no prefill worker available ({len(available)} up, {len(failed)} failed"
                                      f"{': ' + why if why else ''})", self._config.retry_after_s)
        policy.routed(ordered[0], prompt)
        return ordered[0]

    async def _reserve(self, channel: Channel, prompt: Prompt, local: Worker | None = None,
                       busy: bool = False) -> Reserved:
        """Reserve KV on the best D that has room; 503 (with the largest Retry-After) when none has. `local`:
        that D first, and each D asked may prefill the request itself (conditional disaggregation: an uncached
        suffix under --local-prefill-threshold, or, `busy`, a fresh prompt under --busy-local-prefill-tokens)."""
        sub = channel.sub
        ordered = self._decode_policy.order(self._registry.candidates("decode"), len(sub.prompt_token_ids), prompt)
        if local is not None:
            ordered = [local, *(w for w in ordered if w is not local)]
        limit = 0 if local is None else self._reuse.busy_tokens if busy else self._reuse.threshold
        message = Reserve(channel.request_id, sub.prompt_token_ids, sub.sampling.to_dict(), sub.cache_salt,
                          time.time(), limit)
        blocks = -(-(len(sub.prompt_token_ids) + 1) // self._config.block_size)
        retry_after, refusals = self._config.retry_after_s, []
        for decode in ordered:
            # counted before the answer: requests that arrive together are spread, not all sent to the D
            # that looked emptiest before any of them reserved (a heartbeat resets it to what D reports)
            decode.pending_blocks += blocks
            answer = await self._ask_reserve(channel, decode, message)
            if isinstance(answer, Reserved):
                decode.inflight += 1
                channel.decode_counted = True
                return answer
            decode.pending_blocks = max(0, decode.pending_blocks - blocks)
            if isinstance(answer, Refused):
                if answer.status == 400:  # the request itself cannot be served (e.g. larger than the pool)
                    raise APIError(400, f"decode worker refused the request: {answer.message}",
                                   param=answer.param, code=answer.code)
                if answer.status == 503:
                    self._metrics.retries.labels("decode_full").inc()
                    retry_after = max(retry_after, int(answer.retry_after))
                answer = f"{decode.worker_id} answered {answer.status}: {answer.message}"
            refusals.append(answer)
        reason = "; ".join(refusals) if refusals else "none registered"
        raise service_unavailable(f"no decode worker could take the request ({reason})", retry_after)

    async def _ask_reserve(self, channel: Channel, decode: Worker, message: Reserve) -> Reserved | Refused | str:
        """D's answer, or why there is none (link down, lost, or silent past --control-timeout)."""
        try:
            link = await self._ready(decode, "decode")
        except WorkerFailed as exc:
            return str(exc)
        channel.use_decode(link)
        timeout_s = self._config.reserve_timeout_s
        try:
            link.send(message)
            async with asyncio.timeout(timeout_s):
                answer = await asyncio.shield(channel.reserve_answer)
        except (LinkDown, WorkerFailed) as exc:
            channel.leave_decode()
            return f"{decode.worker_id}: {exc}"
        except TimeoutError:
            channel.leave_decode(abort=True)  # it may reserve after all: free it there, without waiting
            self._registry.mark_unreachable(decode.worker_id)  # suspect: no new work until it heartbeats
            log.warning("%s did not answer the reservation of %s within %g s: skipped until its next heartbeat",
                        decode.worker_id, channel.request_id, timeout_s)
            return f"{decode.worker_id} did not answer the reservation within {timeout_s:g} s"
        if isinstance(answer, Refused):
            channel.leave_decode()
        return answer
