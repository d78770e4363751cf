"""Fixtures for the bench tests.

FakeOpenAIServer stands in for a real OpenAI-compatible server only because pdserve's own server was not
ready when these tests were written; it streams real SSE over real HTTP on a loopback port with known delays,
so the client's timings can be checked against them. tiny_tokenizer_dir is a real byte-level BPE tokenizer
trained in a second on ShareGPT text (the shipped data set), loaded through engine/tokenizer.py."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

SHAREGPT = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "sharegpt_v3_sample2k.json.gz"


class FakeOpenAIServer:
    """/v1/models, /v1/completions and /v1/chat/completions streaming `max_tokens` words: the first after
    `ttft_s`, then one every `itl_s`. A prompt containing FAIL gets a 500; one containing EOS an empty answer
    (the model's first token was EOS: one chunk with no text and finish_reason stop, as pdserve and vLLM send
    it); one containing SILENT a stream with no choice at all; every request body is kept."""

    def __init__(self, ttft_s: float = 0.02, itl_s: float = 0.005) -> None:
        self.ttft_s, self.itl_s = ttft_s, itl_s
        self.requests: list[dict[str, Any]] = []
        self.app = FastAPI()
        self.app.get("/v1/models")(self._models)
        self.app.post("/v1/completions")(self._completions)
        self.app.post("/v1/chat/completions")(self._chat)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    async def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def _completions(self, request: Request) -> Any:
        return await self._answer(await request.json(), chat=False)

    async def _chat(self, request: Request) -> Any:
        return await self._answer(await request.json(), chat=True)

    async def _answer(self, body: dict[str, Any], chat: bool) -> Any:
        self.requests.append(body)
        if "FAIL" in json.dumps(body.get("prompt") or body.get("messages")):
            return JSONResponse({"error": {"message": "asked to fail", "type": "server_error"}}, status_code=500)
        prompt = json.dumps(body.get("prompt") or body.get("messages"))
        events = self._eos(chat) if "EOS" in prompt else self._silent() if "SILENT" in prompt else \
            self._events(int(body["max_tokens"]), chat)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _eos(self, chat: bool):
        await asyncio.sleep(self.ttft_s)
        choice = {"index": 0, "delta": {}, "finish_reason": "stop"} if chat else \
            {"index": 0, "text": "", "finish_reason": "stop"}
        yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        usage = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    async def _silent(self):
        yield "data: [DONE]\n\n"

    async def _events(self, n: int, chat: bool):
        await asyncio.sleep(self.ttft_s)
        for i in range(n):
            if i:
                await asyncio.sleep(self.itl_s)
            piece = f" w{i}"
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    def start(self) -> FakeOpenAIServer:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.time() + 10
        while not self._server.started:
            if time.time() > deadline:
                raise RuntimeError("FakeOpenAIServer did not start within 10 s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(timeout=10)


@pytest.fixture(scope="session")
def fake_server():
    server = FakeOpenAIServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sharegpt_path() -> Path:
    if not SHAREGPT.is_file():
        pytest.skip(f"the shared ShareGPT sample is not at {SHAREGPT}")
    return SHAREGPT


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, sharegpt_path: Path) -> Path:
    """A 2,000-token byte-level BPE trained on 300 ShareGPT conversations (about a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with gzip.open(sharegpt_path, "rt", encoding="utf-8") as f:
        data = json.load(f)[:300]
    texts = [turn["value"] for conv in data for turn in conv["conversations"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir: Path):
    from pdserve.bench.tokenizer import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)
