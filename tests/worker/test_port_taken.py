"""A worker given a port another process holds exits with PORT_TAKEN_EXIT, which `pdserve serve` answers by
starting it again on fresh ports (tests/pdserve/test_supervision.py): its HTTP port before the model loads,
its KV transfer port when the decode role starts listening. Real `pdserve decode` processes on the default
model; the port is held by a listening socket of the test's own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.launch_plan import free_port
from pdserve.supervision import PORT_TAKEN_EXIT


@pytest.mark.parametrize("flag", ["--port", "--transfer-port"])
def test_a_worker_given_a_taken_port_exits_with_port_taken(flag: str, model_cache_dir: Path,
                                                             default_model_dir: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        taken = {port}
        ports = {name: str(free_port("127.0.0.1", taken)) for name in ("--port", "--transfer-port")} | {flag: str(port)}
        argv = [sys.executable, "-m", "pdserve.cli", "decode", "--role", "decode", "--host", "127.0.0.1",
                "--router", f"http://127.0.0.1:{free_port('127.0.0.1', taken)}", "--num-blocks", "64", "--torch-threads", "1",
                *(word for item in ports.items() for word in item)]
        env = {**os.environ, "PDSERVE_CACHE_DIR": str(model_cache_dir)}
        done = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == PORT_TAKEN_EXIT, done.stderr[-3000:]
    assert f"{port}" in done.stderr and ("address already in use" in done.stderr.lower())
    loaded = "loading smollm2" in done.stderr
    assert loaded == (flag == "--transfer-port"), done.stderr[-3000:]  # the HTTP port is bound before the load
