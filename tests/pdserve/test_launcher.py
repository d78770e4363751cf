"""The launcher's plan (which processes, which flags) and its no-orphan guarantee when killed outright.
Signals to a running `pdserve serve` are tested end to end in tests/e2e/test_shutdown.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.commands.serve import _MODEL_FLAGS, _WORKER_ONLY_FLAGS, forwarded_flags
from pdserve.launch_plan import free_port, place_on_gpus, plan_children
from pdserve.settings import LaunchSettings


def test_default_plan_is_router_then_one_prefill_and_one_decode() -> None:
    children = plan_children(LaunchSettings(), python="py", num_gpus=0)
    assert [c.name for c in children] == ["router", "prefill-0", "decode-0"]
    router, prefill, decode = (c.argv for c in children)
    assert router[:4] == ["py", "-m", "pdserve.cli", "router"] and router[-2:] == ["--port", "8000"]
    assert prefill[3] == "prefill" and "--transfer-port" not in prefill
    assert decode[3] == "decode" and "--transfer-port" in decode
    for argv in (prefill, decode):
        assert argv[argv.index("--router") + 1] == "http://127.0.0.1:8000"
        assert "--torch-threads" in argv  # the cores are split between the workers
    assert children[0].up_url == children[0].health_url == "http://127.0.0.1:8000/health"  # no API key needed


def test_colocated_and_pool_sizes() -> None:
    [_, both] = plan_children(LaunchSettings(colocated=True), num_gpus=0)
    assert both.argv[3:6] == ["decode", "--role", "both"]
    names = [c.name for c in plan_children(LaunchSettings(num_prefill=2, num_decode=3), num_gpus=0)]
    assert names == ["router", "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"]


def test_several_routers_and_every_worker_registers_with_each() -> None:
    children = plan_children(LaunchSettings(num_routers=2), python="py", num_gpus=0)
    assert [c.name for c in children] == ["router", "router-1", "prefill-0", "decode-0"]
    second = children[1].argv[children[1].argv.index("--port") + 1]
    assert children[1].up_url == f"http://127.0.0.1:{second}/health" and second != "8000"
    for worker in children[2:]:
        assert worker.argv[worker.argv.index("--router") + 1] == f"http://127.0.0.1:8000,http://127.0.0.1:{second}"
    with pytest.raises(ValueError, match="at least one router"):
        LaunchSettings(num_routers=0)


def test_colocated_replicas_spread_over_the_gpus() -> None:
    children = plan_children(LaunchSettings(colocated=True, num_colocated=2), num_gpus=2)
    assert [c.name for c in children] == ["router", "colocated-0", "colocated-1"]
    assert [c.argv[c.argv.index("--device") + 1] for c in children[1:]] == ["cuda:0", "cuda:1"]
    assert all(c.argv[5] == "both" and "--transfer-backend" not in c.argv for c in children[1:])
    with pytest.raises(ValueError, match="together with --colocated"):
        LaunchSettings(num_colocated=2)
    with pytest.raises(ValueError, match="positive"):
        LaunchSettings(colocated=True, num_colocated=0)


def test_workers_share_out_the_gpus() -> None:
    assert place_on_gpus([], 2, num_gpus=0) == [[], []]
    assert place_on_gpus([], 3, num_gpus=4) == [["--device", f"cuda:{i}"] for i in range(3)]
    two_on_one = [["--device", "cuda:0", "--gpu-memory-utilization", "0.400"]] * 2
    assert place_on_gpus([], 2, num_gpus=1) == two_on_one
    assert place_on_gpus(["--device", "cuda:1"], 2, num_gpus=2) == [["--gpu-memory-utilization", "0.400"]] * 2
    assert place_on_gpus(["--num-blocks", "100"], 2, num_gpus=1) == [["--device", "cuda:0"]] * 2
    assert place_on_gpus(["--device", "cpu"], 2, num_gpus=8) == [[], []]


def test_p_and_d_on_gpus_default_to_cuda_ipc_and_cpus_to_the_workers_tcp() -> None:
    def backend(settings: LaunchSettings, num_gpus: int) -> list[str | None]:
        return [c.argv[c.argv.index("--transfer-backend") + 1] if "--transfer-backend" in c.argv else None
                for c in plan_children(settings, num_gpus=num_gpus)[1:]]

    assert backend(LaunchSettings(), num_gpus=1) == ["cuda_ipc", "cuda_ipc"]
    assert backend(LaunchSettings(), num_gpus=0) == [None, None]
    assert backend(LaunchSettings(worker_args=("--device", "cpu")), num_gpus=2) == [None, None]
    assert backend(LaunchSettings(worker_args=("--device", "cuda:0", "--num-blocks", "64")), num_gpus=1) == \
        ["cuda_ipc", "cuda_ipc"]
    assert backend(LaunchSettings(transfer_backend="tcp"), num_gpus=1) == ["tcp", "tcp"]
    assert backend(LaunchSettings(colocated=True), num_gpus=1) == [None]
    with pytest.raises(ValueError, match="--colocated runs one worker"):
        LaunchSettings(colocated=True, transfer_backend="cuda_ipc")
    with pytest.raises(ValueError, match="unknown transfer backend 'local'"):
        LaunchSettings(transfer_backend="local")


def test_serve_forwards_only_changed_flags() -> None:
    args = build_parser().parse_args(["serve", "--load-format", "dummy", "--model-preset", "llama3-8b",
                                      "--num-blocks", "100", "--block-size", "16", "--max-num-seqs", "64"])
    worker = forwarded_flags(args, _MODEL_FLAGS + _WORKER_ONLY_FLAGS)
    # --block-size 16 is the default: not forwarded; --max-num-seqs has none (each worker picks by its device)
    assert worker == ["--load-format", "dummy", "--model-preset", "llama3-8b", "--num-blocks", "100",
                      "--max-num-seqs", "64"]
    sync = build_parser().parse_args(["serve", "--no-async-scheduling"])
    assert forwarded_flags(sync, _WORKER_ONLY_FLAGS) == ["--no-async-scheduling"]
    assert forwarded_flags(args, _MODEL_FLAGS) == ["--load-format", "dummy", "--model-preset", "llama3-8b"]
    eager = build_parser().parse_args(["serve", "--enforce-eager", "--gpu-memory-utilization", "0.4"])
    assert forwarded_flags(eager, _WORKER_ONLY_FLAGS) == ["--enforce-eager", "--gpu-memory-utilization", "0.4"]


PARENT = """
import subprocess, sys, time
from pdserve.launcher import _die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=_die_with_parent)
print(child.pid, flush=True)
time.sleep(60)
"""


def test_children_die_with_a_launcher_killed_outright() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child)


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_free_port_skips_the_ports_already_taken_and_records_its_own() -> None:
    """The kernel's choice is random in ip_local_port_range: with its lower half taken, half the kernel's
    answers would be taken ports, so 40 draws without the check would all be free with odds 2^-40."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    taken = set(range(low, (low + high) // 2))
    for _ in range(40):
        before = set(taken)
        port = free_port("127.0.0.1", taken)
        assert port not in before and taken == before | {port}


def test_a_plan_chooses_no_port_twice_nor_the_routers_own() -> None:
    """CI, 2026-12-06: the kernel handed `pdserve serve --port 36165`'s port, free until its router bound it,
    to decode-0 as well, which exited with "Address already in use" and failed the docs' deployment."""
    for _ in range(20):
        settings = LaunchSettings(port=free_port(), num_routers=2, num_prefill=2, num_decode=3)
        children = plan_children(settings, python="py", num_gpus=0)
        ports = [port for child in children for port in child.ports]
        assert len(ports) == len(set(ports)) == 2 + 2 + 3 * 2 and ports[0] == settings.port
        fresh = children[-1].with_fresh_ports("127.0.0.1", set(ports))
        assert not fresh.ports & set(ports) and len(fresh.ports) == 2


def test_serve_on_a_port_in_use_fails_at_once_naming_it_and_starts_no_child() -> None:
    """The launcher binds each router's address before any child runs (pdserve/listeners.py): before,
    the router found the port taken only after the workers had started loading, and exited with uvicorn's
    status 3."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        started = time.monotonic()
        serve = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port)],
                               check=False, capture_output=True, text=True, timeout=120)
    assert serve.returncode == 1, serve.stderr
    assert f"pdserve serve: cannot listen on 127.0.0.1:{port}: Address already in use" in serve.stderr
    assert "started" not in serve.stdout + serve.stderr  # no router, no worker
    print(f"\nserve on a port in use: exit 1 after {time.monotonic() - started:.2f} s")
