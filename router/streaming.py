"""Relaying started channels to the client: as server-sent events, or collected into one JSON body.

Streaming, one ASGI response per request (no generator, no per-token task):

    sink.take() ─▶ every delta that arrived since the last write ─▶ one event per choice ─▶ one send()
         ▲                                                                                      │
         └──────────────────────────── uvicorn's send waits while the client's socket is full ◀─┘

So a token is written as soon as the TOKENS message that carries it is read, one event per delta (deltas that
arrived together go out in one write, still one event each). Deltas of one choice are merged into one event
only when they queued while the previous write was waiting, i.e. uvicorn's send had suspended on a full client
socket (a write that does not suspend lets nothing else run, so nothing can queue behind it): the stream stays
token by token while the client keeps up, and catches up in one event per choice when it does not.

Whatever ends the relay (last delta, a worker failure, the client gone) closes every channel, which sends
ABORT to the workers still holding the request; a disconnect is noticed while waiting, not at the next write.
Then `Relayed.end` tells `on_end` (the console's request line, router/console.py) how it ended.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdserve.protocol.messages import TokenDelta
from pdserve.router.channel import Channel, DeltaSink, WorkerFailed
from pdserve.router.errors import APIError
from pdserve.router.metrics import RouterMetrics, StreamTimer
from pdserve.router.relay import upstream_error
from pdserve.router.responses import DONE_EVENT, ResponseWriter

CLIENT_CLOSED = 499  # nginx's status for "client closed the request", used in the request counter
_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]


class _ClientGone(Exception):
    pass


class Relayed:
    """The channels of one response, their sink and timers; `deltas()` yields merged batches."""

    def __init__(self, channels: list[Channel], sink: DeltaSink, writer: ResponseWriter, metrics: RouterMetrics,
                 arrival: float, on_end: Callable[[Relayed, int, str | None], None] | None = None) -> None:
        self.channels = channels
        self.sink = sink
        self.writer = writer
        self.metrics = metrics
        self.arrival = arrival
        self.timers = [StreamTimer(metrics, arrival) for _ in channels]
        self._open = len(channels)
        self._on_end = on_end

    @property
    def done(self) -> bool:
        return self._open == 0

    async def next_batch(self, merge: bool = True) -> list[tuple[int, TokenDelta]]:
        """The deltas that arrived since the last call (merged per choice when `merge`), each recorded."""
        items = await self.sink.take()
        now = time.perf_counter()
        merged: dict[int, TokenDelta] = {}
        batch: list[tuple[int, TokenDelta]] = []
        for index, (position, item) in enumerate(items):
            if position < 0 or isinstance(item, WorkerFailed) or item.failed:
                if merged or batch:  # what came before the failure goes out first; the failure next time
                    self.sink.pending[:0] = items[index:]
                    break
                self._raise(position, item)
            assert isinstance(item, TokenDelta)
            self.timers[position].on_frame(now)
            if merge:
                previous = merged.get(position)
                merged[position] = item if previous is None else _merge(previous, item)
            else:
                batch.append((position, item))
        if merge:
            batch = list(merged.items())
        for position, delta in batch:
            self.writer.record(position, delta)
            if delta.finish_reason is not None:
                self._finish(position)
        return batch

    def _raise(self, position: int, item: TokenDelta | WorkerFailed) -> None:
        if position < 0:
            raise _ClientGone
        if isinstance(item, WorkerFailed):
            raise upstream_error(str(item))
        channel = self.channels[position]
        raise upstream_error(f"decode worker {channel.decode.worker_id} ended {channel.request_id} "
                             f"with {item.finish_reason}: {item.error}")

    def _finish(self, position: int) -> None:
        self._open -= 1
        channel, choice = self.channels[position], self.writer.choices[position]
        numbers = channel.prefill_numbers
        if numbers is not None:  # D may not know how much of the prompt P found cached: P's count
            choice.cached_tokens = max(choice.cached_tokens, numbers.num_cached_tokens)
        self.timers[position].on_finish(choice.completion_tokens, len(channel.sub.prompt_token_ids),
                                        choice.cached_tokens, choice.finish_reason)

    def close(self, reason: str) -> None:
        for channel in self.channels:
            channel.close(reason)

    def end(self, status: int, error: str | None = None) -> None:
        """The client has its last byte (`status`, `error`: what it got); choices left unfinished count as
        aborted."""
        for choice in self.writer.choices:
            if choice.finish_reason is None:
                self.metrics.finished_choices.labels("abort").inc()
        if self._on_end is not None:
            self._on_end(self, status, error)


def _merge(a: TokenDelta, b: TokenDelta) -> TokenDelta:
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return TokenDelta(b.request_id, a.token_ids + b.token_ids, a.text + b.text, b.finish_reason, logprobs,
                      b.prompt_tokens, b.completion_tokens, b.cached_tokens, b.error)


class SSEResponse(Response):
    """Server-sent events of a Relayed, written straight to the ASGI `send`."""

    def __init__(self, relayed: Relayed) -> None:  # no body: Response.__init__ is not needed
        self.relayed = relayed
        self.status_code = 200
        self.background = None
        self.error: str | None = None  # the error event's message, when the stream ended with one

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relayed, status = self.relayed, CLIENT_CLOSED
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, relayed.sink))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
            status = await self._events(send)
        finally:
            watcher.cancel()
            relayed.close("the client went away" if status == CLIENT_CLOSED else "the response ended")
            relayed.metrics.count_request(status)
            relayed.end(status, self.error)

    async def _events(self, send: Send) -> int:
        relayed, writer = self.relayed, self.relayed.writer
        body = writer.role_event() if writer.plan.chat else b""
        behind = False  # deltas queued while the last write waited for the client's socket
        try:
            while not relayed.done:
                batch = await relayed.next_batch(merge=behind)
                events = [writer.chunk_event(position, delta) for position, delta in batch]
                body += b"".join(e for e in events if e is not None)
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    body = b""
                    behind = bool(relayed.sink.pending)
            status, tail = 200, (writer.usage_event() if writer.plan.include_usage else b"") + DONE_EVENT
        except _ClientGone:
            return CLIENT_CLOSED
        except APIError as exc:
            status, tail, self.error = exc.status, body + exc.sse_event() + DONE_EVENT, exc.message
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return status


async def _watch_disconnect(receive: Receive, sink: DeltaSink) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    sink.put(-1, WorkerFailed("the client went away"))  # wakes the writer: position -1 means "gone"


async def collect(relayed: Relayed, request: Request) -> dict[str, Any]:
    """The whole response; stops early (closing the channels) if the client disconnects while waiting."""
    watcher = asyncio.get_running_loop().create_task(_watch_disconnect(request.receive, relayed.sink))
    try:
        while not relayed.done:
            await relayed.next_batch()
    except _ClientGone:
        relayed.end(CLIENT_CLOSED)
        raise APIError(CLIENT_CLOSED, "client closed the request") from None
    except APIError as exc:  # counted by the error handler that answers it
        relayed.end(exc.status, exc.message)
        raise
    finally:
        watcher.cancel()
        relayed.close("the response ended")
    relayed.metrics.count_request(200)
    relayed.end(200)
    return relayed.writer.final_body()
