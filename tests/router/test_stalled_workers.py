"""HealthMonitor's stall check (router/health.py) on a registry with a settable clock: a worker whose heartbeats
come but whose step threads stopped (`step_stalled_s`) is taken out of `candidates` once the stall passes
--stream-stall-timeout, and back in once a report shows its steps moving; a late heartbeat alone is no stall."""

from __future__ import annotations

import asyncio

import httpx

from pdserve.router.config import RouterConfig
from pdserve.router.health import HealthMonitor
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import WorkerLoad, WorkerRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def monitor(clock: Clock) -> tuple[HealthMonitor, WorkerRegistry, RouterMetrics]:
    config = RouterConfig(model="m", heartbeat_interval_s=1.0, heartbeat_timeout_s=10.0, stream_stall_timeout_s=4.0)
    registry = WorkerRegistry(config.worker_timeout_s, clock=clock)
    metrics = RouterMetrics()
    return HealthMonitor(registry, httpx.AsyncClient(), config, metrics, {}), registry, metrics


def candidates(registry: WorkerRegistry) -> list[str]:
    return [w.worker_id for w in registry.candidates("decode")]


def test_a_worker_whose_steps_stop_is_stalled_until_they_move_again() -> None:
    clock = Clock()
    health, registry, metrics = monitor(clock)
    registry.register("d0", "http://d0", ("decode",))
    registry.register("d1", "http://d1", ("decode",))
    registry.heartbeat("d0", WorkerLoad(step_stalled_s=3.5))
    registry.heartbeat("d1", WorkerLoad(step_stalled_s=0.2))
    asyncio.run(health.tick())
    assert candidates(registry) == ["d0", "d1"]  # 3.5 s: under the 4 s timeout
    clock.now += 0.6  # no report since: 3.5 + 0.6 s
    asyncio.run(health.tick())
    assert candidates(registry) == ["d1"] and registry.get("d0").stalled  # type: ignore[union-attr]
    assert metrics.stalled_workers._value.get() == 1
    registry.heartbeat("d0", WorkerLoad(step_stalled_s=9.0))  # still stuck: stays out, counted once
    asyncio.run(health.tick())
    assert candidates(registry) == ["d1"] and metrics.stalled_workers._value.get() == 1
    registry.heartbeat("d0", WorkerLoad(step_stalled_s=0.1))  # its forward ended
    asyncio.run(health.tick())
    assert candidates(registry) == ["d0", "d1"]


def test_a_late_heartbeat_is_not_a_stall() -> None:
    clock = Clock()
    health, registry, _ = monitor(clock)
    registry.register("d0", "http://d0", ("decode",))
    registry.heartbeat("d0", WorkerLoad(step_stalled_s=0.3))
    clock.now += 5.0  # heartbeats late (its event loop was busy); the last one said the steps move
    asyncio.run(health.tick())
    assert candidates(registry) == ["d0"]


def test_a_thawed_worker_whose_report_came_late_is_not_stalled() -> None:
    clock = Clock()
    health, registry, _ = monitor(clock)
    registry.register("d0", "http://d0", ("decode",))
    clock.now += 8.0  # frozen (SIGSTOP) for 8 s, under the heartbeat timeout: nothing of it ran, steps included
    registry.heartbeat("d0", WorkerLoad(step_stalled_s=8.2))
    asyncio.run(health.tick())
    assert candidates(registry) == ["d0"]
    clock.now += 1.0  # the next report on time: a step thread that still does not move is stalled
    registry.heartbeat("d0", WorkerLoad(step_stalled_s=9.2))
    asyncio.run(health.tick())
    assert candidates(registry) == []
