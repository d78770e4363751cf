"""FAKE workers for benchmarks/router_relay.py: no model, pre-made tokens as fast as the router takes them.

    python benchmarks/relay_fakes.py --mode data|http --port P --secret S --max-tokens N

One process serving both roles, given to the router as a static worker (`--prefill URL --decode URL`):
  data  the data plane (protocol/): PREFILL answered with PREFILLED at once; each step one TOKENS message
        with a delta ("§", token 100) for every request in flight, written when the router has read the last
        (the connection's drain: TCP backpressure)
  http  the per-request HTTP internal API the router used before the data plane (reserve, a length-prefixed
        msgpack frame stream per request, prefill, abort), each stream yielding its next frame as soon as
        uvicorn has written the last
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.protocol.connection import Connection, ConnectionClosed
from pdserve.protocol.messages import (
    Abort,
    Message,
    Prefill,
    Prefilled,
    PrefillTarget,
    Reserve,
    Reserved,
    TokenDelta,
    Tokens,
)
from pdserve.protocol.server import DataPlaneServer

TOKEN_ID, TEXT = 100, "§"  # one char the JSON around it never holds: the client counts tokens by it


class DataPlaneFake:
    def __init__(self, max_tokens: int, step_ms: float = 0.0) -> None:
        self.max_tokens = max_tokens
        self.step_s = step_ms / 1000  # 0: the next step once the router read the last; else also this apart
        self.server: DataPlaneServer | None = None
        self.active: dict[str, list[Any]] = {}  # request id -> [connection, tokens sent, prompt length]
        self._wake = asyncio.Event()

    def on_message(self, connection: Connection, message: Message) -> None:
        if isinstance(message, Reserve):
            connection.send(Reserved(message.request_id, {"backend": "fake"}))
        elif isinstance(message, PrefillTarget):
            self.active[message.request_id] = [connection, 0, 8]  # D's first delta repeats P's first token
            self._wake.set()
        elif isinstance(message, Prefill):
            connection.send(Prefilled(message.request_id, TOKEN_ID, TEXT, None, None, 0,
                                      len(message.prompt_token_ids), 0.0))
        elif isinstance(message, Abort):
            self.active.pop(message.request_id, None)

    def on_disconnect(self, connection: Connection, reason: str) -> None:
        for rid in [r for r, (c, *_) in self.active.items() if c is connection]:
            del self.active[rid]

    async def produce(self) -> None:
        """One TOKENS message per connection per step, the next step once the router has read it (and, paced,
        `step_s` after the last began, as a decode worker's steps would be)."""
        loop = asyncio.get_running_loop()
        next_step = loop.time()
        while True:
            if not self.active:
                self._wake.clear()
                await self._wake.wait()
            if self.step_s:
                await asyncio.sleep(max(0.0, next_step - loop.time()))
                next_step = max(next_step + self.step_s, loop.time())
            batches: dict[Connection, list[TokenDelta]] = {}
            for rid, entry in list(self.active.items()):
                connection, sent, prompt = entry
                entry[1] = sent = sent + 1
                if sent >= self.max_tokens:
                    del self.active[rid]
                    delta = TokenDelta(rid, [TOKEN_ID], TEXT, "length", None, prompt, sent, 0)
                else:
                    delta = TokenDelta(rid, [TOKEN_ID], TEXT)
                batches.setdefault(connection, []).append(delta)
            for connection, deltas in batches.items():
                with contextlib.suppress(ConnectionClosed):
                    connection.send(Tokens(deltas))
                    await connection.drain()
            await asyncio.sleep(0)


def data_app(fake: DataPlaneFake, secret: str | None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        fake.server = DataPlaneServer(fake, secret, "relay-fake")
        await fake.server.start("127.0.0.1", 0)
        producer = asyncio.get_running_loop().create_task(fake.produce())
        yield
        producer.cancel()
        await fake.server.close()

    app = FastAPI(lifespan=lifespan)

    @app.get("/internal/status")
    async def status() -> dict[str, Any]:
        assert fake.server is not None
        return {"worker_id": "relay-fake", "roles": ["prefill", "decode"], "queue_len": 0, "num_running": 0,
                "num_waiting": 0, "free_blocks": 1 << 20, "total_blocks": 1 << 20, "draining": False,
                "data_port": fake.server.port}

    return app


def _frame(data: dict[str, Any]) -> bytes:
    body = msgpack.packb(data, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def http_app(max_tokens: int) -> FastAPI:
    """The internal HTTP API of the router before the data plane (docs/internal_api.md at 6f59ec0)."""
    app = FastAPI()
    kv_done: dict[str, asyncio.Event] = {}

    @app.post("/internal/reserve")
    async def reserve(body: dict[str, Any]) -> JSONResponse:
        kv_done[body["request_id"]] = asyncio.Event()
        return JSONResponse({"request_id": body["request_id"], "transfer": {"backend": "fake"}})

    @app.post("/internal/prefill")
    async def prefill(body: dict[str, Any]) -> JSONResponse:
        rid = body["request_id"]
        kv_done[rid].set()
        return JSONResponse({"request_id": rid, "first_token_id": TOKEN_ID, "num_cached_tokens": 0,
                             "num_computed_tokens": len(body["prompt_token_ids"]), "prefill_s": 0.0})

    async def frames(rid: str) -> AsyncIterator[bytes]:
        await kv_done[rid].wait()
        try:
            for i in range(1, max_tokens + 1):
                last = i == max_tokens
                yield _frame({"token_ids": [TOKEN_ID], "text": TEXT, "finish_reason": "length" if last else None,
                              "logprobs": None, "prompt_tokens": 8, "completion_tokens": i, "cached_tokens": 0,
                              "error": None})
        finally:
            kv_done.pop(rid, None)

    @app.post("/internal/stream/{rid}")
    async def stream(rid: str) -> StreamingResponse:
        return StreamingResponse(frames(rid), media_type="application/x-msgpack-frames")

    @app.post("/internal/abort/{rid}")
    async def abort(rid: str) -> dict[str, Any]:
        return {"request_id": rid, "aborted": kv_done.pop(rid, None) is not None}

    @app.get("/internal/status")
    async def status() -> dict[str, Any]:
        return {"worker_id": "relay-fake", "roles": ["prefill", "decode"], "queue_len": 0, "num_running": 0,
                "num_waiting": 0, "free_blocks": 1 << 20, "total_blocks": 1 << 20, "draining": False}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("data", "http"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--secret", default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=0.0, help="data mode: steps this far apart at least")
    args = parser.parse_args()
    if args.mode == "data":
        app = data_app(DataPlaneFake(args.max_tokens, args.step_ms), args.secret)
    else:
        app = http_app(args.max_tokens)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, loop="uvloop")


if __name__ == "__main__":
    main()
