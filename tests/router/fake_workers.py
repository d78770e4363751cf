"""FAKE prefill and decode workers that speak docs/internal_api.md over real HTTP, without a model.

Allowed only until the real prefill_node / decode_node exist (the end-to-end tests with real nodes come
later). They exercise everything the router does: reserve (with 503 when "full"), the concurrent stream,
prefill that hands the first token to D (here over HTTP, standing in for kv_transfer), frames, aborts.

Output is a deterministic script: token i of a request has id 1000 + i and text " s{seed}-{i}" (seed -1
when unseeded), so tests can tell n samples apart and check seed + i.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.router.frames import encode_frame

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
    kv_done: asyncio.Event = field(default_factory=asyncio.Event)
    first_token_id: int | None = None


class FakeDecodeWorker:
    """FAKE decode worker. Knobs (set from the test thread): full, token_delay_s, break_after, free_blocks,
    kv_lease_s + kv_failure."""

    def __init__(self, worker_id: str = "fake-d", total_blocks: int = 1000) -> None:
        self.worker_id = worker_id
        self.url = ""  # set once its server runs: the transfer target points at it
        self.full = False
        self.retry_after = 2
        self.token_delay_s = 0.0
        self.break_after: int | None = None  # end the stream without a finish frame after this many frames
        self.stamp_times = False  # text = time.perf_counter() at send, to time the relay
        self.kv_lease_s: float | None = None  # the KV (P's hand-off) must come within this, else kv_failure:
        self.kv_failure = "fail"  # "fail": an error frame, as --kv-load-failure-policy fail; "recompute": go on
        self.total_blocks = total_blocks
        self.free_blocks = total_blocks
        self.cached_tokens = 0
        self.reserved: list[str] = []
        self.refused = 0  # reserve calls answered 503
        self.finished: list[str] = []
        self.closed_early: list[str] = []  # streams the router hung up on before the last frame
        self.aborted: list[str] = []
        self.stream_closed = threading.Event()
        self._reservations: dict[str, Reservation] = {}
        self.app = self._build_app()

    def status(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "roles": ["decode"], "queue_len": 0, "num_running": 0,
                "num_waiting": 0, "free_blocks": self.free_blocks, "total_blocks": self.total_blocks,
                "draining": False}

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/internal/reserve")
        async def reserve(body: dict[str, Any]) -> JSONResponse:
            if self.full:
                self.refused += 1
                return JSONResponse({"error": {"message": "no free KV blocks", "type": "service_unavailable_error",
                                               "code": "kv_full"}, "retry_after": self.retry_after}, 503)
            rid = body["request_id"]
            self._reservations[rid] = Reservation(rid, body["prompt_token_ids"], body["sampling"])
            self.reserved.append(rid)
            return JSONResponse({"request_id": rid, "transfer": {"backend": "fake-http", "url": self.url}})

        @app.post("/fake/kv_done/{rid}")
        async def kv_done(rid: str, body: dict[str, Any]) -> dict[str, Any]:
            reservation = self._reservations[rid]
            reservation.first_token_id = body["first_token_id"]
            reservation.kv_done.set()
            return {}

        @app.post("/internal/stream/{rid}")
        async def stream(rid: str) -> StreamingResponse:
            return StreamingResponse(self._frames(self._reservations[rid]), media_type="application/octet-stream")

        @app.post("/internal/abort/{rid}")
        async def abort(rid: str) -> dict[str, Any]:
            self.aborted.append(rid)
            return {}

        @app.get("/internal/status")
        async def status() -> dict[str, Any]:
            return self.status()

        return app

    async def _frames(self, r: Reservation):
        sent = 0
        try:
            try:
                await asyncio.wait_for(r.kv_done.wait(), self.kv_lease_s)
            except TimeoutError:
                if self.kv_failure == "fail":
                    frame = {**self._frame(r, FIRST_TOKEN_ID, "", 0, "error"), "token_ids": [],
                             "error": f"lease of {self.kv_lease_s} s expired"}
                    yield encode_frame(frame)
                    self.finished.append(r.request_id)
                    return
                r.first_token_id = FIRST_TOKEN_ID  # recomputed here
            max_tokens, seed = r.sampling["max_tokens"], r.sampling["seed"]
            for i in range(max_tokens):
                if self.break_after is not None and sent >= self.break_after:
                    return
                if i and self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                token_id = r.first_token_id if i == 0 else FIRST_TOKEN_ID + i
                last = i == max_tokens - 1
                yield encode_frame(self._frame(r, token_id, token_text(seed, i), i + 1, "length" if last else None))
                sent += 1
            self.finished.append(r.request_id)
        finally:
            if r.request_id not in self.finished:
                self.closed_early.append(r.request_id)
                self.stream_closed.set()

    def _frame(self, r: Reservation, token_id: int, text: str, count: int, finish: str | None) -> dict[str, Any]:
        k = r.sampling.get("logprobs")
        logprobs = None if k is None else [
            {"token_id": token_id, "logprob": -0.5, "top": [[token_id, -0.5], [token_id + 1, -1.5]][:k]}]
        if self.stamp_times:
            text = f"{time.perf_counter():.6f};"
        return {"token_ids": [token_id], "text": text, "finish_reason": finish, "logprobs": logprobs,
                "prompt_tokens": len(r.prompt_token_ids), "completion_tokens": count,
                "cached_tokens": self.cached_tokens, "error": None}


class FakePrefillWorker:
    """FAKE prefill worker: hands the first token to D over HTTP. Knobs: fail (answer 500), hang_s."""

    def __init__(self, worker_id: str = "fake-p") -> None:
        self.worker_id = worker_id
        self.fail = False
        self.hang_s = 0.0  # wait this long before handing the KV off (a stalled prefill worker)
        self.prefilled: list[str] = []
        self.aborted: list[str] = []
        self.queue_len = 0
        self.app = self._build_app()

    def status(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "roles": ["prefill"], "queue_len": self.queue_len, "num_running": 0,
                "num_waiting": 0, "free_blocks": 100, "total_blocks": 100, "draining": False}

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            async with httpx.AsyncClient() as client:  # one client: creating one costs ~50 ms (SSL context)
                self._client = client
                yield

        app = FastAPI(lifespan=lifespan)

        @app.post("/internal/prefill")
        async def prefill(body: dict[str, Any]) -> JSONResponse:
            rid = body["request_id"]
            self.prefilled.append(rid)
            if self.fail:
                return JSONResponse({"error": {"message": "prefill crashed", "type": "server_error",
                                               "code": None}}, 500)
            if self.hang_s:
                await asyncio.sleep(self.hang_s)
            await self._client.post(f"{body['transfer']['url']}/fake/kv_done/{rid}",
                                    json={"first_token_id": FIRST_TOKEN_ID})
            n = len(body["prompt_token_ids"])
            return JSONResponse({"request_id": rid, "first_token_id": FIRST_TOKEN_ID, "num_cached_tokens": 0,
                                 "num_computed_tokens": n, "prefill_s": 0.001})

        @app.post("/internal/abort/{rid}")
        async def abort(rid: str) -> dict[str, Any]:
            self.aborted.append(rid)
            return {}

        @app.get("/internal/status")
        async def status() -> dict[str, Any]:
            return self.status()

        return app
