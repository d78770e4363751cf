"""A worker's links to several routers (worker/router_links.py): it registers with every router a name or a
list gives, heartbeats each with its prefix events, re-registers with a router that restarted (which then
catches up from a snapshot), follows the name's addresses as they change, and leaves them all.

Real routers on loopback: two addresses on one port (127.0.0.1 and 127.0.0.2), as two router pods behind a
headless Service. What cannot run here is DNS answering one name with both addresses (that needs the
system's resolver configuration), so those tests hand RouterLinks a resolver over a table (`TableDNS`); the
real resolver is tested on names this machine resolves. The worker side is `StandInWorker`: the two reports
a worker makes (registration, status) without loading a model; tests/deploy/test_two_routers.py runs real
workers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.launch_plan import free_port
from pdserve.protocol.prefix_events import PrefixPublisher
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.worker.router_links import RouterLinks, RouterLinkSettings, resolve_addresses, with_address
from tests.router.uvicorn_thread import ServerThread

MODEL = "smollm2-135m-instruct"
HOSTS = ("127.0.0.1", "127.0.0.2")


class StandInWorker:
    """What a worker reports, without a model (see the module docstring)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id

    def registration(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "url": "http://127.0.0.1:9", "roles": ["prefill"], "model": MODEL,
                "block_size": 16, "num_blocks": 64, "fingerprint": "fp"}

    def status(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "queue_len": 0, "free_blocks": 64, "total_blocks": 64}


class TableDNS:
    """A resolver over a table (see the module docstring): name -> addresses, changed by the test."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table

    async def __call__(self, host: str, port: int) -> list[str]:
        if host not in self.table:
            raise OSError(f"{host}: no such name")
        return list(self.table[host])


class Routers:
    """Real routers on one port, one per loopback address; `restart(i)` brings one back empty."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.port = free_port("127.0.0.1")
        self.servers: list[ServerThread | None] = [None, None]
        self.apps: list[Any] = [None, None]
        for i in range(2):
            self.start(i)

    def start(self, i: int) -> None:
        self.apps[i] = create_app(RouterConfig(model=MODEL, heartbeat_interval_s=0.1), self.tokenizer)
        self.servers[i] = ServerThread(self.apps[i], host=HOSTS[i], port=self.port).start()

    def stop(self, i: int) -> None:
        server, self.servers[i] = self.servers[i], None
        if server is not None:
            server.stop()

    def restart(self, i: int) -> None:
        self.stop(i)
        self.start(i)

    def url(self, i: int) -> str:
        return f"http://{HOSTS[i]}:{self.port}"

    def worker(self, i: int, worker_id: str) -> Any:
        return self.apps[i].state.router.registry.get(worker_id)


@pytest.fixture
def routers(tokenizer: Tokenizer) -> Iterator[Routers]:
    pair = Routers(tokenizer)
    yield pair
    for i in range(2):
        pair.stop(i)


@pytest.fixture(scope="session")
def tokenizer(default_tokenizer: Tokenizer) -> Tokenizer:
    return default_tokenizer


@contextlib.asynccontextmanager
async def running(links: RouterLinks) -> AsyncIterator[RouterLinks]:
    task = asyncio.create_task(links.run())
    try:
        yield links
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def _links(urls: tuple[str, ...], held: set[bytes], resolver: Any = resolve_addresses,
           resolve_interval_s: float = 5.0) -> RouterLinks:
    settings = RouterLinkSettings(urls, "p0", heartbeat_interval_s=0.1, resolve_interval_s=resolve_interval_s)
    publisher = PrefixPublisher(lambda: set(held), min_interval_s=0.0)
    return RouterLinks(settings, StandInWorker("p0"), publisher, lambda: False, resolver)


def _in_step(routers: Routers, i: int, held: set[bytes]) -> bool:
    worker = routers.worker(i, "p0")
    return worker is not None and worker.prefixes.replica.in_step and worker.prefixes.reported == held


async def test_a_list_registers_with_every_router_and_a_restarted_one_catches_up(routers: Routers) -> None:
    held = {b"key-0001", b"key-0002"}
    links = _links((routers.url(0), routers.url(1)), held)
    assert not links.registered
    async with running(links):
        await until(lambda: _in_step(routers, 0, held) and _in_step(routers, 1, held))
        assert links.registered
        held.add(b"key-0003")  # events, not snapshots, from here on
        await until(lambda: _in_step(routers, 0, held) and _in_step(routers, 1, held))
        # the router holds seq 2 once it answered; the link reads that answer a moment later (it failed the
        # suite under load, read at once: the test's poll ran between the router's update and the link's)
        await until(lambda: (links.links[routers.url(1)].acked or ("", 0))[1] == 2)
        routers.restart(1)
        assert routers.worker(1, "p0") is None
        held.discard(b"key-0001")
        await until(lambda: _in_step(routers, 0, held) and _in_step(routers, 1, held))


async def test_a_name_stands_for_every_address_and_is_looked_up_again(routers: Routers) -> None:
    dns = TableDNS({"routers.test": list(HOSTS)})
    held = {b"key-0001"}
    links = _links((f"http://routers.test:{routers.port}",), held, dns, resolve_interval_s=0.1)
    async with running(links):
        await until(lambda: _in_step(routers, 0, held) and _in_step(routers, 1, held))
        dns.table["routers.test"] = [HOSTS[0]]  # router 1's pod went away
        await until(lambda: list(links.links) == [routers.url(0)])
        dns.table.clear()  # DNS out: the links stay as they are
        await asyncio.sleep(0.3)
        assert list(links.links) == [routers.url(0)]
        routers.restart(1)  # a new router pod, listed again
        dns.table["routers.test"] = list(HOSTS)
        await until(lambda: _in_step(routers, 1, held))


async def test_leave_deregisters_from_every_router(routers: Routers) -> None:
    links = _links((routers.url(0), routers.url(1)), set())
    async with running(links):
        await until(lambda: all(routers.worker(i, "p0") is not None for i in range(2)))
        await links.leave()
        assert all(routers.worker(i, "p0") is None for i in range(2))


async def test_a_router_down_does_not_hold_up_the_others(routers: Routers) -> None:
    routers.stop(1)
    held = {b"key-0001"}
    links = _links((routers.url(0), routers.url(1)), held)
    async with running(links):
        await until(lambda: _in_step(routers, 0, held))
        routers.start(1)
        await until(lambda: _in_step(routers, 1, held))


async def test_the_real_resolver() -> None:
    assert await resolve_addresses("127.0.0.2", 80) == ["127.0.0.2"]  # a literal: no lookup
    assert "127.0.0.1" in await resolve_addresses("localhost", 80)
    with pytest.raises(OSError):
        await resolve_addresses("no-such-router.invalid", 80)
    assert with_address("http://routers:8000/", "10.0.0.5") == "http://10.0.0.5:8000"
    assert with_address("https://routers", "fd00::5") == "https://[fd00::5]:443"


def test_no_router_is_a_static_worker() -> None:
    assert _links((), set()).registered
