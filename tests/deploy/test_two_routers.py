"""Two routers in front of one pool, as `pdserve serve --num-routers 2` plans them (pdserve/launch_plan.py) and as
deploy/k8s runs them behind a headless Service: every worker registers with both, and the cache-aware
prefill choice of each router follows the prefix events of every worker.

Real processes on loopback (2 routers, 2 prefill workers, 1 decode worker, the default model), real HTTP:

    1. a prompt sent to either router is prefilled somewhere; its prefix is then asked for through the OTHER
       router, which sends it to the worker holding that prefix (cached tokens > 0) — with 4 prefixes, a
       router that did not know would pick the holder of all 4 by chance 1 time in 16
    2. one router is killed and started again, empty: the workers re-register, send it their snapshot, and the
       same prefixes land on their holders through it
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.launch_plan import ChildSpec, free_port
from pdserve.launcher import Launcher, spawn
from pdserve.protocol.prefix_summary import decode_summary
from pdserve.settings import LaunchSettings
from tests.deploy.kustomize import adapter_series

MODEL = "smollm2-135m-instruct"
SECRET = "two-router-test-secret"
INTERNAL = {"X-PDServe-Secret": SECRET}
WORKER_FLAGS = ("--num-blocks", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                "--torch-threads", "1")
PREFIXES = [f"Document {i}: " + " ".join(f"{word}{i}" for word in ("alpha", "beta", "gamma", "delta", "epsilon",
                                                                  "zeta", "eta", "theta") * 8) for i in range(4)]


class TwoRouters:
    """The launcher's children, started by the launcher; a router can be restarted on its own port."""

    def __init__(self, cache_dir: Path) -> None:
        # --local-prefill-threshold 0: prefixes go to the prefill worker holding them, never prefilled on D
        settings = LaunchSettings(port=free_port(), num_routers=2, num_prefill=2, num_decode=1,
                                  worker_args=WORKER_FLAGS, router_args=("--local-prefill-threshold", "0"),
                                  ready_timeout_s=300)
        env = {**os.environ, "PDSERVE_CACHE_DIR": str(cache_dir), "PDSERVE_SECRET": SECRET}
        self.launcher = Launcher(settings, grace_s=15, env=env)

    def start(self) -> TwoRouters:
        self.launcher.start()
        self.launcher.wait_ready()
        return self

    def spec(self, name: str) -> ChildSpec:
        return self.launcher.child(name).spec

    def url(self, name: str) -> str:
        return self.spec(name).health_url.removesuffix("/health")

    @property
    def routers(self) -> list[str]:
        return [self.url("router"), self.url("router-1")]

    def workers(self, prefix: str) -> list[str]:
        return [child.spec.health_url.removesuffix("/health") for child in self.launcher.children
                if child.name.startswith(prefix)]

    def restart(self, name: str) -> None:
        child = self.launcher.child(name)  # by hand: this test does not run the launcher's supervision
        child.process.send_signal(signal.SIGTERM)
        child.process.wait(timeout=30)
        child.process = spawn(child.spec, self.launcher.env)


@pytest.fixture(scope="module")
def two_routers(model_cache_dir: Path, default_model_dir: Path) -> Iterator[TwoRouters]:
    deployment = TwoRouters(model_cache_dir)
    try:
        yield deployment.start()
    finally:
        deployment.launcher.stop()


def _completed(worker_url: str) -> float:
    text = httpx.get(f"{worker_url}/metrics", timeout=10).text
    match = re.search(r"^pdserve_prefill_requests_completed(?:_total)? ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, text[:500]
    return float(match.group(1))


def _complete(router: str, prompt: str) -> tuple[int, dict[str, Any]]:
    reply = httpx.post(f"{router}/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"], reply.json()


def _served_by(deployment: TwoRouters, router: str, prompt: str) -> tuple[str, int]:
    """(the prefill worker that served it, its cached prompt tokens); requests go one at a time."""
    before = {url: _completed(url) for url in deployment.workers("prefill")}
    cached, _ = _complete(router, prompt)
    after = {url: _completed(url) for url in deployment.workers("prefill")}
    [worker] = [url for url in before if after[url] > before[url]]
    return worker, cached


def _converged(deployment: TwoRouters, timeout_s: float = 30.0) -> None:
    """Until every router lists, for every prefill worker, as many cached blocks as the worker holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {}
        for url in deployment.workers("prefill"):
            status = httpx.get(f"{url}/internal/status", headers=INTERNAL, timeout=10).json()
            held[status["worker_id"]] = len(decode_summary(status.get("cached_blocks", "")))
        views = []
        for router in deployment.routers:
            try:
                listed = httpx.get(f"{router}/internal/workers", headers=INTERNAL, timeout=10).json()["workers"]
            except httpx.HTTPError:
                listed = []
            views.append({w["worker_id"]: w["cached_blocks"] for w in listed if "prefill" in w["roles"]})
        if all(view == held for view in views) and sum(held.values()) > 0:
            return
        assert time.monotonic() < deadline, f"not converged: workers hold {held}, routers see {views}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def holders(two_routers: TwoRouters) -> dict[int, str]:
    """Each prefix sent once, alternately through either router: prefix index -> the worker that holds it."""
    return {i: _served_by(two_routers, two_routers.routers[i % 2], prefix + " First question?")[0]
            for i, prefix in enumerate(PREFIXES)}


def test_a_prefix_lands_on_its_holder_through_either_router(two_routers: TwoRouters, holders: dict[int, str]) -> None:
    _converged(two_routers)
    for i, prefix in enumerate(PREFIXES):
        other = two_routers.routers[(i + 1) % 2]
        worker, cached = _served_by(two_routers, other, prefix + " Another question, please?")
        assert (worker, cached > 0) == (holders[i], True), f"prefix {i} through {other}; holders {holders}"


def test_a_restarted_router_catches_up(two_routers: TwoRouters, holders: dict[int, str]) -> None:
    two_routers.restart("router-1")
    restarted = two_routers.url("router-1")
    deadline = time.monotonic() + 120
    while not _healthy(restarted):
        assert time.monotonic() < deadline, "the restarted router got no workers back"
        time.sleep(0.3)
    _converged(two_routers)
    for i, prefix in enumerate(PREFIXES):
        worker, cached = _served_by(two_routers, restarted, prefix + " A third question here?")
        assert (worker, cached > 0) == (holders[i], True), f"prefix {i} through {restarted}; holders {holders}"


def test_the_series_the_autoscalers_read_are_exported(two_routers: TwoRouters) -> None:
    """deploy/k8s/prometheus-adapter's rules query these on the workers' /metrics (P's and D's alike: every
    worker runs both nodes)."""
    for url in two_routers.workers("prefill") + two_routers.workers("decode"):
        text = httpx.get(f"{url}/metrics", timeout=10).text
        samples = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                   if line and not line.startswith("#")}
        exported = {name.split("{")[0] for name in samples}
        assert adapter_series() <= exported, f"{url} lacks {adapter_series() - exported}"
        assert samples["pdserve_prefill_queued_prompt_tokens"] == 0  # idle: nothing queued
        assert 0 <= samples["pdserve_decode_kv_usage"] < 1


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
