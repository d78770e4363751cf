"""Pieces the serving benchmarks share: a `pdserve serve` deployment in its own process group, the decode
worker's step counters, machine load, and a client that talks to the workers' data plane directly
(reserve on D, prefill on P, read D's deltas: what the router does, minus the router).

Imported by benchmarks/serving_cpu.py and benchmarks/decode_step_cpu.py (run as scripts from the repository
root; the scripts' folder is on sys.path).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil

from pdserve.decode_node.engine import DEVICE_PARTS, STEP_PHASES
from pdserve.process_group import ProcessGroup, http_ok, serve_command
from pdserve.protocol.connection import Connection, connect
from pdserve.protocol.framing import FrameLimits
from pdserve.protocol.messages import Prefill, PrefillTarget, Reserve, Reserved, Tokens
from pdserve.router.internal_routes import SECRET_HEADER


def machine_load() -> dict[str, float | str]:
    """`uptime`'s load averages (other sessions share these cores) and the time they were read."""
    one, five, fifteen = os.getloadavg()
    return {"at": time.strftime("%Y-%m-%d %H:%M:%S"), "load1": one, "load5": five, "load15": fifteen,
            "cpus": os.cpu_count() or 0}


def wait_for_quiet(max_load: float, max_wait_s: float) -> dict[str, float | str]:
    """Wait (up to max_wait_s) for the 1-minute load to drop to max_load; returns the load when starting."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(10.0)
    return machine_load()


class Deployment:
    """`pdserve serve [flags]` on `port`, started in a new session so that stopping it reaches every child.
    Its internal API's shared secret is ours (`headers` carry it), so /internal/* can be called directly."""

    def __init__(self, port: int, flags: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.argv = serve_command(port, flags)
        self.log = log
        self.env = env or {}  # extra environment of every process (e.g. PYTHONPATH for an experiment)
        self.secret = secrets.token_hex(16)
        self.headers = {SECRET_HEADER: self.secret}
        self.group: ProcessGroup | None = None

    @property
    def process(self) -> subprocess.Popen | None:
        return None if self.group is None else self.group.popen

    def __enter__(self) -> Deployment:  # noqa: PYI034
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1", "PDSERVE_SECRET": self.secret}
        self.group = ProcessGroup(self.argv, self.log, env).start()
        try:
            self.group.wait_until(lambda: http_ok(self.url + "/health"), 600.0, self.url, poll_s=1.0)
        except TimeoutError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.group is not None:
            self.group.stop(grace_s=30)

    def child_cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far by each child: router, prefill-0, decode-0 / colocated-0."""
        assert self.process is not None
        out = {}
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                argv, times = child.cmdline(), child.cpu_times()
            except psutil.NoSuchProcess:
                continue
            name = argv[argv.index("--worker-id") + 1] if "--worker-id" in argv else "router"
            out[name] = times.user + times.system
        return out

    def model(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/internal/workers", headers=self.headers, timeout=10).json()["workers"]

    def worker_url(self, role: str) -> str:
        return next(w["url"] for w in self.workers() if role in w["roles"])

    def data_address(self, role: str) -> tuple[str, int]:
        worker = next(w for w in self.workers() if role in w["roles"])
        return urlsplit(worker["url"]).hostname or "127.0.0.1", worker["data_port"]


def decode_counters(worker_url: str) -> dict[str, float]:
    """The decode worker's step counters from its /metrics (names without the `_total` suffix)."""
    values: dict[str, float] = {}
    for line in httpx.get(worker_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve_decode_"):
            name, _, value = line.rpartition(" ")
            values[name.replace("_total", "")] = float(value)
    return values


def step_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean decode step between two counter readings: batch, wall ms, ms per phase, forward CPU ms."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = max(delta("pdserve_decode_steps"), 1.0)
    out = {"steps": delta("pdserve_decode_steps"), "mean_batch": delta("pdserve_decode_batched_rows") / steps,
           "tokens_per_step": delta("pdserve_decode_generated_tokens") / steps,
           "step_ms": 1000 * delta("pdserve_decode_step_seconds") / steps,
           "forward_cpu_ms": 1000 * delta("pdserve_decode_forward_cpu_seconds") / steps,
           "preemptions": delta("pdserve_decode_preemptions"),
           "mean_forward_rows": delta("pdserve_decode_forward_rows") / steps}  # the bucket, padding included
    for phase in STEP_PHASES:
        out[f"{phase}_ms"] = 1000 * delta(f'pdserve_decode_step_phase_seconds{{phase="{phase}"}}') / steps
    for part in DEVICE_PARTS:  # CUDA only (0 on CPU): the device's own time, beside the host's wall phases
        out[f"device_{part}_ms"] = 1000 * delta(f'pdserve_decode_step_device_seconds{{part="{part}"}}') / steps
    return out


@dataclass
class DirectOutput:
    """One request driven through the internal API: when each token frame arrived (perf_counter seconds)."""

    sent_at: float
    frame_times: list[float] = field(default_factory=list)
    num_tokens: int = 0
    error: str = ""


class DirectLinks:
    """One data-plane connection to P and one to D, as the router holds them, each with its reader."""

    def __init__(self, prefill: Connection, decode: Connection) -> None:
        self.prefill, self.decode = prefill, decode
        self.waiting: dict[str, asyncio.Queue] = {}
        self._readers = [asyncio.create_task(self._read(c)) for c in (prefill, decode)]

    @classmethod
    async def open(cls, dep: Deployment) -> DirectLinks:
        limits = FrameLimits()
        (p, _), (d, _) = [await connect(*dep.data_address(role), dep.secret, "benchmark", limits)
                          for role in ("prefill", "decode")]
        return cls(p, d)

    async def _read(self, connection: Connection) -> None:
        while (message := await connection.recv()) is not None:
            now = time.perf_counter()
            items = message.deltas if isinstance(message, Tokens) else [message]
            for item in items:
                queue = self.waiting.get(item.request_id)
                if queue is not None:
                    queue.put_nowait((now, item))

    def close(self) -> None:
        for task in self._readers:
            task.cancel()
        self.prefill.close()
        self.decode.close()


async def direct_request(links: DirectLinks, prompt: list[int], max_tokens: int) -> DirectOutput:
    """PREFILL to P and RESERVE to D together, the target to P once D answered (as the router does); the time
    each of D's deltas arrived."""
    rid = f"direct-{uuid.uuid4().hex[:12]}"
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    out = DirectOutput(time.perf_counter())
    queue: asyncio.Queue = links.waiting.setdefault(rid, asyncio.Queue())
    try:
        links.prefill.send(Prefill(rid, prompt, sampling, None))
        links.decode.send(Reserve(rid, prompt, sampling, None, time.time()))
        while True:
            now, item = await queue.get()
            if isinstance(item, Reserved):
                links.prefill.send(PrefillTarget(rid, item.transfer))
            elif hasattr(item, "token_ids"):  # a delta of D's
                if item.token_ids:
                    out.frame_times.append(now)
                    out.num_tokens += len(item.token_ids)
                if item.error:
                    out.error = item.error
                if item.finish_reason is not None:
                    return out
            elif hasattr(item, "status"):  # REFUSED / PREFILL_FAILED
                out.error = f"{type(item).__name__} {item.status}: {item.message}"
                return out
    finally:
        links.waiting.pop(rid, None)
