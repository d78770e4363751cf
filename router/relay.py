"""The life of one sub-request against the workers (docs/internal_api.md):

    pick P ─▶ reserve on D ──200──▶ open D's stream ─┐   (concurrently)
               │   └─503/refused: next D, else 503   ├─▶ POST prefill on P ──ok──▶ DecodeStream (frames)
               │                                     │        └─failed: close stream, abort on D and P,
               └────────◀── once more (another P if P failed) ◀──┘          then once more, else 503

While P works, D's stream is watched (router/decode_stream.py): D may end the request first because its KV
did not arrive (lease ran out, P gone; `--kv-load-failure-policy fail` on D): that attempt failed, P is given
up (aborted in the background: it may hang) and another P is tried. Or D may start streaming without P's
answer (`recompute`: D prefilled the prompt itself): after `_FIRST_TOKEN_GRACE_S` P's answer is no longer
awaited and P is aborted. A decode worker that dies during the attempt costs one attempt, not the prefill
worker (the registry marks it unreachable at the next connection refused).

A DecodeStream is closed by its consumer; closing it before the last frame closes the HTTP stream, which is
how D learns that the client went away (it aborts the request and frees its blocks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

import httpx

from pdserve.router.config import RouterConfig
from pdserve.router.decode_stream import NO_PREFILL, DecodeStream, PrefillResult, WorkerFailed, failed_frame
from pdserve.router.errors import APIError, service_unavailable
from pdserve.router.metrics import RouterMetrics
from pdserve.router.plan import SubRequest
from pdserve.router.policies import Policy, Prompt
from pdserve.router.registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)
SECRET_HEADER = "X-PDServe-Secret"
_ATTEMPTS = 2  # the first try, then one more (with another P when P failed)
# D streams its first token as soon as P's "done" frame lands, normally milliseconds before P's HTTP answer
_FIRST_TOKEN_GRACE_S = 2.0


def upstream_error(message: str) -> APIError:
    return APIError(502, message, type="server_error", code="worker_failed")


class Relay:
    def __init__(self, client: httpx.AsyncClient, registry: WorkerRegistry, prefill_policy: Policy,
                 decode_policy: Policy, config: RouterConfig, metrics: RouterMetrics) -> None:
        self._client = client
        self._registry = registry
        self._prefill_policy = prefill_policy
        self._decode_policy = decode_policy
        self._config = config
        self._metrics = metrics
        self._headers = {SECRET_HEADER: config.secret} if config.secret else {}
        self._background: set[asyncio.Task[None]] = set()

    def set_policies(self, prefill: Policy, decode: Policy) -> None:
        """Swap the policies (admin API); sub-requests already started keep the workers they were given."""
        self._prefill_policy = prefill
        self._decode_policy = decode

    async def start_all(self, subs: list[SubRequest]) -> list[DecodeStream]:
        """Start every sub-request; all or none (the started ones are closed when one fails)."""
        if len(subs) == 1:
            return [await self.start(subs[0])]
        tasks = [asyncio.create_task(self.start(sub)) for sub in subs]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if not failed:
            return [t.result() for t in tasks]
        for task in tasks:  # stop the others' prefills: they free what they hold as they unwind
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(r.close() for r in results if isinstance(r, DecodeStream)))
        raise failed[0].exception()  # type: ignore[misc]

    async def start(self, sub: SubRequest) -> DecodeStream:
        failed: dict[str, str] = {}  # prefill worker id -> why
        reasons: list[str] = []
        prompt = Prompt(sub.prompt_token_ids, sub.cache_salt)
        for attempt in range(_ATTEMPTS):
            prefill = self._pick_prefill(prompt, failed)
            request_id = sub.request_id if attempt == 0 else f"{sub.request_id}-retry{attempt}"
            decode, transfer = await self._reserve(sub, request_id)
            try:
                return await self._run(sub, request_id, prefill, decode, transfer)
            except WorkerFailed as exc:
                log.warning("attempt %d of %s failed: %s", attempt + 1, sub.request_id, exc)
                self._metrics.retries.labels(exc.reason).inc()
                reasons.append(str(exc))
                if exc.role == "prefill":
                    failed[prefill.worker_id] = str(exc)
        raise service_unavailable(f"failed on {len(reasons)} attempts: {'; '.join(reasons)}",
                                  self._config.retry_after_s)

    async def _run(self, sub: SubRequest, request_id: str, prefill: Worker, decode: Worker,
                   transfer: dict[str, Any]) -> DecodeStream:
        """Open D's stream and prefill on P concurrently, watching D meanwhile; on any failure free what both
        hold (P's abort in the background when P may be what hangs)."""
        decode.inflight += 1
        opening = asyncio.create_task(self._open_stream(decode, request_id))
        prefilling = asyncio.create_task(self._prefill(prefill, sub, request_id, transfer))
        stream: DecodeStream | None = None
        try:
            stream = DecodeStream(sub, await opening, decode)
            await self._await_start(stream, prefilling, prefill, request_id)
        except BaseException as exc:
            decode.inflight -= 1
            suspect = isinstance(exc, WorkerFailed) and exc.reason == "kv_failed"
            await finish_despite_cancel(self._undo(opening, prefilling, stream, request_id, prefill, decode,
                                                   wait_for_prefill=not suspect))
            raise
        return stream

    async def _await_start(self, stream: DecodeStream, prefilling: asyncio.Task[PrefillResult], prefill: Worker,
                           request_id: str) -> None:
        """Until P answered, or D ended the request (its KV failed) or began it on its own (recomputed)."""
        head = stream.watch()
        await asyncio.wait({prefilling, head}, return_when=asyncio.FIRST_COMPLETED)
        first = None
        if not prefilling.done():
            first = head.result()  # WorkerFailed when D broke the stream
            if failed_frame(first):
                raise WorkerFailed(f"decode worker {stream.decode.worker_id} ended {request_id} before P answered "
                                   f"({first.finish_reason}: {first.error})", "prefill", "kv_failed")
            await asyncio.wait({prefilling}, timeout=_FIRST_TOKEN_GRACE_S)
        if prefilling.done() and (first is None or prefilling.exception() is None):
            stream.prefill = prefilling.result()
            self._metrics.prefill.observe(stream.prefill.prefill_s)
            return
        log.warning("%s: decode worker %s streams without an answer from prefill worker %s (it recomputed the "
                    "prompt); aborting it there", request_id, stream.decode.worker_id, prefill.worker_id)
        self._metrics.retries.labels("kv_recomputed").inc()
        prefilling.cancel()
        self._in_background(self._abort(prefill, request_id))
        stream.prefill = NO_PREFILL

    def _in_background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._background.discard)

    async def _undo(self, opening: asyncio.Task[httpx.Response], prefilling: asyncio.Task[PrefillResult],
                    stream: DecodeStream | None, request_id: str, prefill: Worker, decode: Worker,
                    wait_for_prefill: bool = True) -> None:
        opening.cancel()
        prefilling.cancel()
        await asyncio.gather(prefilling, return_exceptions=True)
        if stream is not None:
            await stream.discard()
        else:
            try:
                response = await opening
                await response.aclose()
            except (asyncio.CancelledError, WorkerFailed, APIError, httpx.HTTPError):
                pass  # the stream never opened
        if wait_for_prefill:
            await asyncio.gather(self._abort(decode, request_id), self._abort(prefill, request_id))
        else:
            self._in_background(self._abort(prefill, request_id))
            await self._abort(decode, request_id)

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

    async def _reserve(self, sub: SubRequest, request_id: str) -> tuple[Worker, dict[str, Any]]:
        """Reserve KV on the best D that has room; 503 (with the largest Retry-After) when none has."""
        ordered = self._decode_policy.order(self._registry.candidates("decode"), len(sub.prompt_token_ids))
        body = {"request_id": request_id, "prompt_token_ids": sub.prompt_token_ids,
                "sampling": sub.sampling.to_dict(), "cache_salt": sub.cache_salt, "arrival_time": time.time()}
        retry_after = self._config.retry_after_s
        refusals: list[str] = []
        blocks = -(-(len(sub.prompt_token_ids) + 1) // self._config.block_size)
        for decode in ordered:
            # counted before the call: requests that arrive together are spread, not all sent to the D that
            # looked emptiest before any of them reserved (a heartbeat resets the count to what D reports)
            decode.pending_blocks += blocks
            try:
                response = await self._post(decode, "/internal/reserve", body, self._config.control_timeout_s)
            except asyncio.CancelledError:  # the reservation may be made as we leave: free it
                await finish_despite_cancel(self._abort(decode, request_id))
                raise
            except WorkerFailed as exc:
                decode.pending_blocks = max(0, decode.pending_blocks - blocks)
                if isinstance(exc.__cause__, httpx.TimeoutException):  # it may have reserved after all
                    await self._abort(decode, request_id)
                refusals.append(str(exc))
                continue
            if response.status_code == 200:
                return decode, response.json()["transfer"]
            decode.pending_blocks = max(0, decode.pending_blocks - blocks)
            error = _error_of(response)
            if response.status_code == 400:  # the request itself cannot be served (e.g. larger than the pool)
                raise APIError(400, f"decode worker refused the request: {error.get('message')}",
                               param=error.get("param"), code=error.get("code"))
            if response.status_code == 503:
                self._metrics.retries.labels("decode_full").inc()
                retry_after = max(retry_after, int(error.get("retry_after") or 0))
            refusals.append(f"{decode.worker_id} answered {response.status_code}: {error.get('message')}")
        reason = "; ".join(refusals) if refusals else "none registered"
        raise service_unavailable(f"no decode worker could take the request ({reason})", retry_after)

    async def _prefill(self, prefill: Worker, sub: SubRequest, request_id: str,
                       transfer: dict[str, Any]) -> PrefillResult:
        body = {"request_id": request_id, "prompt_token_ids": sub.prompt_token_ids,
                "sampling": sub.sampling.to_dict(), "cache_salt": sub.cache_salt, "transfer": transfer}
        prefill.inflight += 1
        try:
            response = await self._post(prefill, "/internal/prefill", body, self._config.prefill_timeout_s)
        finally:
            prefill.inflight -= 1
        if response.status_code == 400:
            error = _error_of(response)
            raise APIError(400, f"prefill worker refused the request: {error.get('message')}",
                           param=error.get("param"), code=error.get("code"))
        if response.status_code != 200:
            raise WorkerFailed(f"{prefill.worker_id} answered {response.status_code}: "
                               f"{_error_of(response).get('message')}")
        data = response.json()
        return PrefillResult(data["first_token_id"], data.get("num_cached_tokens", 0),
                             data.get("num_computed_tokens", 0), data.get("prefill_s", 0.0))

    async def _open_stream(self, decode: Worker, request_id: str) -> httpx.Response:
        c = self._config
        timeout = httpx.Timeout(c.control_timeout_s, connect=c.connect_timeout_s, read=c.stream_idle_timeout_s)
        request = self._client.build_request("POST", f"{decode.url}/internal/stream/{request_id}",
                                             headers=self._headers, timeout=timeout)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.TransportError as exc:
            if isinstance(exc, httpx.ConnectError):
                self._registry.mark_unreachable(decode.worker_id)
            raise WorkerFailed(f"cannot open the stream on {decode.worker_id}: {exc!r}", "decode",
                               "decode_failed") from exc
        if response.status_code != 200:
            await response.aread()
            await response.aclose()
            raise WorkerFailed(f"{decode.worker_id} answered {response.status_code} to the stream of {request_id}: "
                               f"{_error_of(response).get('message')}", "decode", "decode_failed")
        return response

    async def _post(self, worker: Worker, path: str, body: dict[str, Any], read_timeout_s: float) -> httpx.Response:
        timeout = httpx.Timeout(read_timeout_s, connect=self._config.connect_timeout_s)
        try:
            return await self._client.post(f"{worker.url}{path}", json=body, headers=self._headers, timeout=timeout)
        except httpx.TransportError as exc:
            if isinstance(exc, httpx.ConnectError):  # nobody listens: skip it until it reports again
                self._registry.mark_unreachable(worker.worker_id)
            role = "prefill" if path == "/internal/prefill" else "decode"
            raise WorkerFailed(f"{worker.worker_id} unreachable on {path}: {exc!r}", role, f"{role}_failed") from exc

    async def _abort(self, worker: Worker, request_id: str) -> None:
        try:
            await self._post(worker, f"/internal/abort/{request_id}", {}, self._config.control_timeout_s)
        except WorkerFailed as exc:
            log.warning("abort of %s on %s failed: %s", request_id, worker.worker_id, exc)


async def finish_despite_cancel(cleanup: Coroutine[Any, Any, None]) -> None:
    """Run `cleanup` to its end even if the caller is cancelled meanwhile (then re-raise the cancellation).

    asyncio.shield alone is not enough: a cancelled caller stops waiting while the cleanup runs on, so the
    client could be answered before the workers were told to free what they hold."""
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


def _error_of(response: httpx.Response) -> dict[str, Any]:
    """The `error` object of an OpenAI-style error body (or the raw text as its message)."""
    try:
        data = response.json()
    except ValueError:
        return {"message": response.text[:200]}
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return {**data["error"], "retry_after": data.get("retry_after", data["error"].get("retry_after"))}
    return {"message": str(data)[:200]}
