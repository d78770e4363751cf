"""Security on real processes: the OpenAI API needs the API key (--api-key / PDSERVE_API_KEY); every internal
endpoint and KV transfer port needs the shared secret (PDSERVE_SECRET); the admin API its token; every socket
listens on loopback by default; and no pickle call ran in any process of the session (this module runs last:
every request of every reliability test went through processes under the pickle guard)."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import openai
import pytest

from tests.reliability.cluster import API_KEY, MODEL, Cluster, Proc, metric
from tests.reliability.data_plane import refuses_a_wrong_secret
from tests.reliability.raw_wire import frame, read_frame

OPENAI_CALLS = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}),
                ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})]
WORKER_CALLS = [("GET", "/internal/status"), ("POST", "/internal/drain"), ("POST", "/internal/role"),
                ("GET", "/internal/cache"), ("POST", "/internal/cache/clear"), ("GET", "/internal/control")]


def test_the_openai_api_needs_the_api_key(cluster: Cluster) -> None:
    for method, path, body in OPENAI_CALLS:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": API_KEY}):
            reply = httpx.request(method, f"{cluster.url}{path}", json=body, headers=headers, timeout=10)
            assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key", (path, headers)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert [m.id for m in cluster.client().models.list().data] == [MODEL]
    assert httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200  # service routes stay open


def workers(cluster: Cluster) -> list[Proc]:
    return [p for p in cluster.workers.values() if p.alive()]


def test_internal_endpoints_and_transfer_ports_need_the_secret(cluster: Cluster) -> None:
    refused = 0
    for headers in ({}, {"X-PDServe-Secret": "not-the-secret"}):
        for method, path in [("GET", "/internal/workers"), ("POST", "/internal/workers/register")]:
            assert httpx.request(method, f"{cluster.url}{path}", json={}, headers=headers).status_code == 401
            refused += 1
        for proc in workers(cluster):
            for method, path in WORKER_CALLS:
                reply = httpx.request(method, f"{proc.url}{path}", json={}, headers=headers, timeout=10)
                assert reply.status_code == 401, (proc.name, path, reply.status_code)
                refused += 1
    assert httpx.get(f"{cluster.url}/admin/workers", timeout=10).status_code == 401
    for proc in workers(cluster):
        if proc.role == "decode":
            assert transfer_port_refuses(proc), proc.name
        assert refuses_a_wrong_secret("127.0.0.1", cluster.status(proc)["data_port"]), proc.name
    print(f"\nRELIABILITY secret: {refused} internal calls without or with a wrong secret -> 401; every decode "
          f"worker's transfer port and every worker's data plane refused a wrong HMAC")


def transfer_port_refuses(proc: Proc) -> bool:
    """A peer with the wrong secret gets an error frame, then the connection closes."""
    with socket.create_connection(("127.0.0.1", proc.transfer_port), timeout=10) as sock:
        hello = read_frame(sock)
        assert hello is not None and hello["kind"] == "hello"
        sock.sendall(frame({"kind": "auth", "mac": b"\x00" * 32}))
        answer = read_frame(sock)
        return answer is not None and answer["kind"] == "error" and "authentication failed" in answer["reason"] \
            and read_frame(sock) is None


def listening_addresses(pid: int) -> list[str]:
    """host:port of every TCP socket the process listens on (/proc, no psutil)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append(f"{_ip(address, width)}:{int(port, 16)}")
    return found


def _ip(hex_address: str, width: int) -> str:
    raw = bytes.fromhex(hex_address)
    if width == 8:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def test_every_socket_listens_on_loopback(cluster: Cluster) -> None:
    procs = [cluster.router, *workers(cluster)]
    addresses = {p.name: listening_addresses(p.pid) for p in procs if p is not None}
    for proc in workers(cluster):  # HTTP, the data plane, the KV receiver (both nodes are built, whatever the role)
        assert len(addresses[proc.name]) >= 3, addresses
    bad = {name: a for name, a in addresses.items() if any(not x.startswith(("127.0.0.1:", "::1:")) for x in a)}
    assert not bad, bad
    print(f"\nRELIABILITY loopback: {sum(map(len, addresses.values()))} listening sockets of {len(procs)} "
          f"processes, all on 127.0.0.1")


def test_no_pickle_ran_in_any_process(cluster: Cluster) -> None:
    text = cluster.pickle_log.read_text() if cluster.pickle_log.exists() else ""
    violations = [block for block in text.split("\n\n") if block.startswith("PICKLE")]
    assert not violations, "pickle ran outside imports:\n" + "\n\n".join(violations[:3])
    allowed = sum(block.startswith("ALLOWED") for block in text.split("\n\n"))
    served = metric(cluster.router, "pdserve_requests_total")
    assert served > 0
    print(f"\nRELIABILITY pickle: 0 pickle calls outside imports in any process under the guard "
          f"({allowed} at import time, e.g. jinja2's bytecode-cache header); the router answered {served:.0f} API "
          f"requests meanwhile")
