"""FAKE prefill and decode workers without a model: the real data-plane server (protocol/server.py) on a
loopback port, the real status route over HTTP, and a scripted engine behind them. They let the router tests
turn failures on and off that real workers only show under faults (the e2e and reliability tests run the
real workers).

Output is a deterministic script: token i of a request has id 1000 + i and text " s{seed}-{i}" (seed -1
when unseeded), so tests can tell n samples apart and check seed + i. P hands the first token to D through a
shared in-process table (standing in for kv_transfer), and answers the router with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from pdserve.protocol.connection import Connection
from pdserve.protocol.messages import (
    Abort,
    Message,
    Prefill,
    Prefilled,
    PrefillFailed,
    PrefillTarget,
    Refused,
    Reserve,
    Reserved,
    TokenDelta,
    Tokens,
)
from pdserve.protocol.server import DataPlaneServer

FIRST_TOKEN_ID = 1000


def token_text(seed: int | None, i: int) -> str:
    return f" s{-1 if seed is None else seed}-{i}"


def expected_text(seed: int | None, max_tokens: int) -> str:
    return "".join(token_text(seed, i) for i in range(max_tokens))


@dataclass
class Reservation:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    connection: Connection
    kv_done: asyncio.Event = field(default_factory=asyncio.Event)
    first_token_id: int | None = None
    task: asyncio.Task[None] | None = None


class _FakeWorker:
    """The parts both fakes share: an HTTP app with /internal/status and a data-plane server in its loop."""

    role = ""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.data = DataPlaneServer(self, None, worker_id)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.app = self._build_app()
        self.extra_status: dict[str, Any] = {}  # more status fields (counters, metrics), as a test sets them

    def status(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "roles": [self.role], "queue_len": 0, "num_running": 0,
                "num_waiting": 0, "free_blocks": 100, "total_blocks": 100, "draining": False,
                "data_port": self.data.port, **self.extra_status}

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            self.loop = asyncio.get_running_loop()
            await self.data.start("127.0.0.1", 0)
            yield
            await self.data.close()

        app = FastAPI(lifespan=lifespan)

        @app.get("/internal/status")
        async def status() -> dict[str, Any]:
            return self.status()

        return app

    def on_message(self, connection: Connection, message: Message) -> None:
        raise NotImplementedError

    def on_disconnect(self, connection: Connection, reason: str) -> None:
        pass

    def drop_connections(self) -> None:
        """Break every router connection (thread-safe): what a crash looks like from the router."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(lambda: [c.close() for c in list(self.data.connections)])


class FakeDecodeWorker(_FakeWorker):
    """FAKE decode worker. Knobs (set from the test thread): full, token_delay_s, break_after, free_blocks,
    kv_lease_s + kv_failure, stamp_times, text_padding."""

    role = "decode"

    def __init__(self, worker_id: str = "fake-d", total_blocks: int = 1000) -> None:
        self.full = False
        self.retry_after = 2
        self.token_delay_s = 0.0
        self.break_after: int | None = None  # drop the connection after this many deltas of a request
        self.stamp_times = False  # text = time.perf_counter() at send, to time the relay
        self.text_padding = 0  # characters appended to each token's text (a stream of many megabytes)
        self.kv_lease_s: float | None = None  # the KV (P's hand-off) must come within this, else kv_failure:
        self.kv_failure = "fail"  # "fail": an error delta, as --kv-load-failure-policy fail; "recompute": go on
        self.total_blocks = total_blocks
        self.free_blocks = total_blocks
        self.cached_tokens = 0
        self.reserved: list[str] = []
        self.refused = 0  # reserve calls answered 503
        self.finished: list[str] = []
        self.closed_early: list[str] = []  # requests the router aborted (or lost) before their last delta
        self.aborted: list[str] = []
        self.stream_closed = threading.Event()
        self._reservations: dict[str, Reservation] = {}  # live ones
        self.requests: dict[str, Reservation] = {}  # every reservation made, for the tests to inspect
        super().__init__(worker_id)

    def status(self) -> dict[str, Any]:
        return {**super().status(), "free_blocks": self.free_blocks, "total_blocks": self.total_blocks}

    def on_message(self, connection: Connection, message: Message) -> None:
        if isinstance(message, Reserve):
            self._reserve(connection, message)
        elif isinstance(message, Abort):
            self.aborted.append(message.request_id)
            reservation = self._reservations.pop(message.request_id, None)
            if reservation is not None and reservation.task is not None:
                reservation.task.cancel()

    def on_disconnect(self, connection: Connection, reason: str) -> None:
        for rid, reservation in list(self._reservations.items()):
            if reservation.connection is connection and reservation.task is not None:
                reservation.task.cancel()

    def _reserve(self, connection: Connection, message: Reserve) -> None:
        rid = message.request_id
        if self.full:
            self.refused += 1
            connection.send(Refused(rid, 503, "no free KV blocks", self.retry_after, code="kv_full"))
            return
        reservation = Reservation(rid, message.prompt_token_ids, message.sampling, connection)
        self._reservations[rid] = self.requests[rid] = reservation
        self.reserved.append(rid)
        connection.send(Reserved(rid, {"backend": "fake", "worker_id": self.worker_id}))
        reservation.task = asyncio.get_running_loop().create_task(self._stream(reservation))

    def kv_done(self, rid: str, first_token_id: int) -> None:
        """P's hand-off (called from P's thread)."""
        assert self.loop is not None

        def done() -> None:
            reservation = self._reservations.get(rid)
            if reservation is not None:
                reservation.first_token_id = first_token_id
                reservation.kv_done.set()

        self.loop.call_soon_threadsafe(done)

    async def _stream(self, r: Reservation) -> None:
        sent = 0
        try:
            try:
                await asyncio.wait_for(r.kv_done.wait(), self.kv_lease_s)
            except TimeoutError:
                if self.kv_failure == "fail":
                    self._send(r, TokenDelta(r.request_id, [], "", "error", None, len(r.prompt_token_ids), 0, 0,
                                             f"lease of {self.kv_lease_s} s expired"))
                    self.finished.append(r.request_id)
                    return
                r.first_token_id = FIRST_TOKEN_ID  # recomputed here
            max_tokens, seed = r.sampling["max_tokens"], r.sampling["seed"]
            for i in range(max_tokens):
                if self.break_after is not None and sent >= self.break_after:
                    r.connection.close()
                    return
                if i and self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                token_id = r.first_token_id if i == 0 else FIRST_TOKEN_ID + i
                last = i == max_tokens - 1
                self._send(r, self._delta(r, token_id, token_text(seed, i), i + 1, "length" if last else None))
                sent += 1
            self.finished.append(r.request_id)
        finally:
            self._reservations.pop(r.request_id, None)
            if r.request_id not in self.finished:
                self.closed_early.append(r.request_id)
                self.stream_closed.set()

    def _send(self, r: Reservation, delta: TokenDelta) -> None:
        if not r.connection.closed:
            r.connection.send(Tokens([delta]))

    def _delta(self, r: Reservation, token_id: int, text: str, count: int, finish: str | None) -> TokenDelta:
        k = r.sampling.get("logprobs")
        logprobs = None if k is None else [
            {"token_id": token_id, "logprob": -0.5, "top": [[token_id, -0.5], [token_id + 1, -1.5]][:k]}]
        if self.stamp_times:
            text = f"{time.perf_counter():.6f};"
        text += "." * self.text_padding
        return TokenDelta(r.request_id, [token_id], text, finish, logprobs, len(r.prompt_token_ids), count,
                          self.cached_tokens)


class FakePrefillWorker(_FakeWorker):
    """FAKE prefill worker: hands the first token to D (its in-process table), answers the router after D
    has it, so D's first delta comes first. Knobs: fail (answer 500), hang_s, answer_first."""

    role = "prefill"

    def __init__(self, worker_id: str = "fake-p", decoders: dict[str, FakeDecodeWorker] | None = None) -> None:
        self.fail = False
        self.hang_s = 0.0  # wait this long before handing the KV off (a stalled prefill worker)
        self.answer_first = False  # answer the router with the first token before handing it to D
        self.answer_after_s = 0.01  # otherwise answer this long after handing it to D
        self.cached_tokens = 0  # the prompt tokens P reports found in its prefix cache
        self.prefilled: list[str] = []
        self.aborted: list[str] = []
        self.queue_len = 0
        self.decoders = decoders if decoders is not None else {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._targets: dict[str, asyncio.Future[dict[str, Any]]] = {}
        super().__init__(worker_id)

    def status(self) -> dict[str, Any]:
        return {**super().status(), "queue_len": self.queue_len}

    def on_message(self, connection: Connection, message: Message) -> None:
        if isinstance(message, Prefill):
            self.prefilled.append(message.request_id)
            target = self._targets[message.request_id] = asyncio.get_running_loop().create_future()
            self._tasks[message.request_id] = asyncio.get_running_loop().create_task(
                self._prefill(connection, message, target))
        elif isinstance(message, PrefillTarget):
            future = self._targets.get(message.request_id)
            if future is not None and not future.done():
                future.set_result(message.transfer)
        elif isinstance(message, Abort):
            self.aborted.append(message.request_id)
            task = self._tasks.pop(message.request_id, None)
            if task is not None:
                task.cancel()

    async def _prefill(self, connection: Connection, message: Prefill,
                       target: asyncio.Future[dict[str, Any]]) -> None:
        rid = message.request_id
        try:
            transfer = await target
            if self.fail:
                connection.send(PrefillFailed(rid, 500, "prefill crashed"))
                return
            if self.hang_s:
                await asyncio.sleep(self.hang_s)
            answer = Prefilled(rid, FIRST_TOKEN_ID, token_text(message.sampling["seed"], 0),
                               "length" if message.sampling["max_tokens"] == 1 else None, None, self.cached_tokens,
                               len(message.prompt_token_ids) - self.cached_tokens, 0.001)
            if self.answer_first:
                connection.send(answer)
                await asyncio.sleep(0.05)
            self.decoders[transfer["worker_id"]].kv_done(rid, FIRST_TOKEN_ID)
            if not self.answer_first:
                await asyncio.sleep(self.answer_after_s)
                connection.send(answer)
        finally:
            self._tasks.pop(rid, None)
            self._targets.pop(rid, None)
