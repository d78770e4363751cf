"""A worker's links to its routers: register with every router, heartbeat each, leave them all.

    --router http://pdserve-router-peers:8000     a host name stands for every address it resolves to, looked
                                                  up again every --router-resolve-interval (a Kubernetes
                                                  headless Service lists every router pod; so does a Compose
                                                  service scaled to several routers)
    --router http://10.0.0.5:8000,http://10.0.0.6:8000     several URLs; each may be a name as well

    RouterLinks.run   every resolve interval: the addresses now ─▶ one RouterLink task per address
                      (a new one registers; one no longer listed stops; a failed lookup keeps what it had)
    RouterLink.run    register ─▶ heartbeat every interval: load + prefix events (protocol/prefix_events.py,
                      acknowledged per router by the heartbeat's answer) ─▶ 404: the router forgot us, register
                      again (a restarted router is back in step within two heartbeats)
    RouterLinks.leave deregister from every router (a drain that exits: worker/control.py)

Registration and heartbeats are HTTP (docs/internal_api.md); a router that does not answer only makes its
own link retry, never the others late.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import httpx

from pdserve.settings import ServerSettings

logger = logging.getLogger("pdserve.worker")
SECRET_HEADER = "X-PDServe-Secret"
FIRST_LOOKUP_RETRY_S = 1.0  # while no router address is known yet (its Service not created, DNS not ready)

Resolver = Callable[[str, int], Awaitable[list[str]]]


class WorkerReports(Protocol):
    """What a worker says to its routers (worker/assembly.py's Worker)."""

    def registration(self) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...


class PrefixFields(Protocol):
    """The prefix cache part of a heartbeat, kept per router (worker/cache.py's PrefixPublisher)."""

    def fields(self, acked: tuple[str, int] | None) -> dict[str, Any]: ...

    def acknowledged(self, answer: Any) -> tuple[str, int] | None: ...


@dataclass(frozen=True)
class RouterLinkSettings:
    urls: tuple[str, ...]  # as given: names or addresses
    worker_id: str
    secret: str | None = None
    heartbeat_interval_s: float = 1.0  # until a router answers its registration with its own
    resolve_interval_s: float = 5.0

    @classmethod
    def of(cls, server: ServerSettings, worker_id: str) -> RouterLinkSettings:
        return cls(server.router_urls, worker_id, server.secret, server.heartbeat_interval_s,
                   server.router_resolve_interval_s)

    @property
    def headers(self) -> dict[str, str]:
        return {SECRET_HEADER: self.secret} if self.secret else {}


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, in the resolver's order; an IP literal is itself (no lookup)."""
    try:
        ipaddress.ip_address(host)
        return [host]
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def with_address(url: str, address: str) -> str:
    """`url` with its host replaced by `address` (port, scheme and path kept)."""
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    return urlunsplit((parts.scheme, f"{host}:{_port(url)}", parts.path.rstrip("/"), "", ""))


def _port(url: str) -> int:
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


class RouterLink:
    """One router at one address: register, then heartbeat until stopped or the worker left."""

    def __init__(self, url: str, settings: RouterLinkSettings, client: httpx.AsyncClient, reports: WorkerReports,
                 prefix: PrefixFields | None, left: Callable[[], bool]) -> None:
        self.url = url
        self.registered = False
        self.acked: tuple[str, int] | None = None  # (epoch, seq) of our prefix events this router holds
        self._settings = settings
        self._client = client
        self._reports = reports
        self._prefix = prefix
        self._left = left
        self._interval = settings.heartbeat_interval_s
        self._failing = False

    async def run(self) -> None:
        while not self._left():
            try:
                if not self.registered:
                    await self._register()
                elif not await self._heartbeat():
                    continue  # the router forgot us: register again at once
                self._failing = False
            except (httpx.HTTPError, ValueError) as exc:
                if not self._failing:  # once per outage, not once per heartbeat
                    logger.warning("router %s unreachable: %r", self.url, exc)
                self._failing = True
            await asyncio.sleep(self._interval)

    async def _register(self) -> None:
        reply = await self._client.post(f"{self.url}/internal/workers/register", json=self._reports.registration())
        reply.raise_for_status()
        self._interval = float(reply.json().get("heartbeat_interval_s", self._interval))
        self.registered, self.acked = True, None  # a new registration knows none of our prefix events
        logger.info("registered with %s as %s", self.url, self._settings.worker_id)

    async def _heartbeat(self) -> bool:
        """False when the router does not know us (404)."""
        body = self._reports.status()
        if self._prefix is not None:
            body |= self._prefix.fields(self.acked)
        reply = await self._client.post(f"{self.url}/internal/workers/heartbeat", json=body)
        if reply.status_code == 404:
            self.registered = False
            return False
        reply.raise_for_status()
        if self._prefix is not None:
            answer = reply.json()
            self.acked = self._prefix.acknowledged(answer.get("prefix") if isinstance(answer, dict) else None)
        return True


class RouterLinks:
    """Every router the worker registers with (none: a static worker, always `registered`)."""

    def __init__(self, settings: RouterLinkSettings, reports: WorkerReports, prefix: PrefixFields | None,
                 left: Callable[[], bool], resolver: Resolver = resolve_addresses) -> None:
        self.settings = settings
        self._reports = reports
        self._prefix = prefix
        self._left = left
        self._resolver = resolver
        self._addresses: dict[str, list[str]] = {}  # each --router URL -> the link URLs it resolved to last
        self.links: dict[str, RouterLink] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def registered(self) -> bool:
        """With at least one router (or with none configured)."""
        return not self.settings.urls or any(link.registered for link in self.links.values())

    async def run(self) -> None:
        if not self.settings.urls:
            return
        async with httpx.AsyncClient(headers=self.settings.headers, timeout=5.0, trust_env=False) as client:
            try:
                while not self._left():
                    await self.refresh(client)
                    await asyncio.sleep(self.settings.resolve_interval_s if self.links
                                        else min(FIRST_LOOKUP_RETRY_S, self.settings.resolve_interval_s))
            finally:
                await self._stop(list(self._tasks))

    async def refresh(self, client: httpx.AsyncClient) -> None:
        """Look every name up again; start links to new addresses, stop those to addresses gone."""
        wanted = await self.resolve()
        for url in wanted:
            if url not in self.links:
                self.links[url] = RouterLink(url, self.settings, client, self._reports, self._prefix, self._left)
                self._tasks[url] = asyncio.create_task(self.links[url].run())
                logger.info("router %s found", url)
        gone = [url for url in self.links if url not in wanted]
        for url in gone:
            logger.info("router %s no longer listed: not heartbeating it any more", url)
        await self._stop(gone)

    async def resolve(self) -> list[str]:
        """The link URLs of every --router URL; a URL whose lookup fails keeps the addresses it had."""
        for url in self.settings.urls:
            parts = urlsplit(url)
            try:
                addresses = await self._resolver(parts.hostname or "", _port(url))
            except OSError as exc:
                logger.warning("cannot resolve %s (%r); keeping %s", parts.hostname, exc, self._addresses.get(url, []))
                continue
            self._addresses[url] = [with_address(url, address) for address in addresses]
        return list(dict.fromkeys(u for urls in self._addresses.values() for u in urls))

    async def _stop(self, urls: list[str]) -> None:
        tasks = [self._tasks.pop(url) for url in urls]
        for url in urls:
            self.links.pop(url, None)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def leave(self) -> None:
        """Deregister from every router known now (WorkerControl.leave, once a drain is done)."""
        urls = list(self.links)
        if not urls:
            return
        async with httpx.AsyncClient(headers=self.settings.headers, timeout=5.0, trust_env=False) as client:
            await asyncio.gather(*(_deregister(client, url, self.settings.worker_id) for url in urls))


async def _deregister(client: httpx.AsyncClient, url: str, worker_id: str) -> None:
    try:
        reply = await client.post(f"{url}/internal/workers/deregister", json={"worker_id": worker_id})
        if reply.status_code not in (200, 404):  # 404: the router forgot us already
            logger.warning("router %s refused the deregistration: %s", url, reply.text[:200])
    except httpx.HTTPError as exc:  # it drops us after the heartbeat timeout anyway
        logger.warning("cannot deregister from %s: %r", url, exc)
