"""The deployment plan_validation.py measures: router + 1 P + 1 D as `pdserve` processes, P and D pinned to
their own cores (so neither steals the other's), the router on the next two or unpinned on a small machine."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def core_range(first: int, count: int) -> str:
    return f"{first}-{first + count - 1}"


def spawn_pinned(argv: list[str], cpus: str | None, threads: int, log: Path,
           extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """cpus None: unpinned."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           **(extra_env or {})}
    # pinning keeps P and D off each other's cores
    pin = ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []
    return subprocess.Popen([*pin, *argv], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float = 300.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a server process exited early (codes {[p.poll() for p in procs]})")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def start_cluster(args: argparse.Namespace, logs: Path) -> list[subprocess.Popen]:
    """P and D on `threads` cores each; the router on the next 2, or unpinned when the machine has no more."""
    base = [sys.executable, "-m", "pdserve.cli"]
    model = args.model_args
    url = f"http://127.0.0.1:{args.port}"
    t = args.threads
    spare = (os.cpu_count() or 1) >= 2 * t + 2
    router_cpus = core_range(2 * t, 2) if spare else None
    procs = [spawn_pinned([*base, "router", "--port", str(args.port), *model], router_cpus, 2 if spare else 1,
                    logs / "router.log")]
    time.sleep(3.0)
    engine = ["--device", "cpu", "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
              str(args.max_num_batched_tokens), "--num-blocks", str(args.num_blocks)]
    env = dict(item.split("=", 1) for item in args.worker_env)
    procs.append(spawn_pinned([*base, "prefill", "--role", "prefill", "--router", url, "--port", "0", *model, *engine],
                        core_range(0, t), t, logs / "prefill.log", env))
    procs.append(spawn_pinned([*base, "decode", "--role", "decode", "--router", url, "--port", "0", *model, *engine],
                        core_range(t, t), t, logs / "decode.log", env))
    _wait_ready(url, procs)
    return procs


def stop_cluster(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
