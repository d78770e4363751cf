"""Router test fixtures: the real default tokenizer, and clusters of a real router (uvicorn, loopback) in
front of FAKE prefill/decode workers (tests/router/fake_workers.py: the real data-plane server, a scripted
engine) whose failures the tests switch on."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from fake_workers import FakeDecodeWorker, FakePrefillWorker
from uvicorn_thread import ServerThread, stop_all

from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def tokenizer(default_tokenizer: Tokenizer) -> Tokenizer:
    """The default model's real tokenizer (tests/conftest.py)."""
    return default_tokenizer


@dataclass
class Cluster:
    router: ServerThread
    app: Any
    prefill: list[FakePrefillWorker]
    decode: list[FakeDecodeWorker]
    prefill_servers: list[ServerThread] = field(default_factory=list)
    decode_servers: list[ServerThread] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def state(self) -> Any:
        return self.app.state.router

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=10, **kwargs)


ClusterFactory = Callable[..., Cluster]


@contextlib.contextmanager
def cluster_factory(tokenizer: Tokenizer) -> Iterator[ClusterFactory]:
    """make(num_prefill=1, num_decode=1, static=True, **RouterConfig fields) -> a running Cluster; every
    server started through it stops when the context ends."""
    servers: list[ServerThread] = []

    def serve(app: Any) -> ServerThread:
        servers.append(ServerThread(app).start())
        return servers[-1]

    def make(num_prefill: int = 1, num_decode: int = 1, static: bool = True, **overrides: Any) -> Cluster:
        decode = [FakeDecodeWorker(f"fake-d{i}") for i in range(num_decode)]
        by_id = {d.worker_id: d for d in decode}
        prefill = [FakePrefillWorker(f"fake-p{i}", by_id) for i in range(num_prefill)]
        p_servers = [serve(p.app) for p in prefill]
        d_servers = [serve(d.app) for d in decode]
        config = RouterConfig(model=MODEL, prefill_urls=tuple(s.url for s in p_servers) if static else (),
                              decode_urls=tuple(s.url for s in d_servers) if static else (),
                              **{"max_model_len": 2048, "poll_interval_s": 0.2, **overrides})
        app = create_app(config, tokenizer)
        return Cluster(serve(app), app, prefill, decode, p_servers, d_servers)

    try:
        yield make
    finally:
        stop_all(servers)


@pytest.fixture
def make_cluster(tokenizer: Tokenizer) -> Iterator[ClusterFactory]:
    """A fresh cluster per test, for tests that turn the fake workers' knobs."""
    with cluster_factory(tokenizer) as make:
        yield make


@pytest.fixture(scope="module")
def cluster(tokenizer: Tokenizer) -> Iterator[Cluster]:
    """One router + one FAKE P + one FAKE D shared by a module's tests (which must not turn knobs)."""
    with cluster_factory(tokenizer) as make:
        yield make()
