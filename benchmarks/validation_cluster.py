"""The deployment plan_validation.py measures: router + 1 P + 1 D as `pdserve` processes, P and D pinned to
their own cores (so neither steals the other's), the router on the next two or unpinned on a small machine;
and how the benchmark talks to it (the bench client's requests, the workers' /metrics counters)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx

from pdserve.bench.client import ApiTarget, RequestOutput
from pdserve.bench.datasets import Conversation
from pdserve.bench.runner import LoadSpec, run_benchmark
from pdserve.process_group import ProcessGroup, http_ok


def core_range(first: int, count: int) -> str:
    return f"{first}-{first + count - 1}"


def spawn_pinned(argv: list[str], cpus: str | None, threads: int, log: Path,
                 extra_env: dict[str, str] | None = None) -> ProcessGroup:
    """cpus None: unpinned."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           **(extra_env or {})}
    # pinning keeps P and D off each other's cores
    pin = ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []
    return ProcessGroup([*pin, *argv], log, env).start()


def _wait_ready(url: str, procs: list[ProcessGroup], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.wait_until(lambda: http_ok(url + "/health"), max(0.0, deadline - time.monotonic()), url, poll_s=1.0)


def start_cluster(args: argparse.Namespace, logs: Path) -> list[ProcessGroup]:
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


def stop_cluster(procs: list[ProcessGroup]) -> None:
    for p in procs:
        if not p.exited():
            p.signal(signal.SIGTERM)
    for p in procs:
        p.stop(grace_s=20)


def drive(url: str, convs: list[Conversation], rate: float, burstiness: float,
          max_concurrency: int | None = None) -> tuple[list[RequestOutput], float]:
    target = ApiTarget(url, "/v1/completions", model=model_name(url), ignore_eos=True)
    load = LoadSpec(rate, burstiness, max_concurrency, seed=1)
    result = asyncio.run(run_benchmark(convs, target, load, progress=False))
    failed = [o.error for o in result.outputs if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
    return result.outputs, result.duration


def model_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def worker_counters(url: str) -> dict[str, float]:
    """The prefill and decode workers' /metrics counters (names without `_total`), found through the router."""
    workers = httpx.get(url + "/internal/workers", timeout=10).json()["workers"]
    values: dict[str, float] = {}
    for role in ("prefill", "decode"):
        w_url = next(w["url"] for w in workers if role in w["roles"])
        for line in httpx.get(w_url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(f"pdserve_{role}_"):
                name, _, value = line.rpartition(" ")
                values[name.replace("_total", "")] = float(value)
    return values


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)
