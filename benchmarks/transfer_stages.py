"""When P's staged senders (tcp, store, nccl: kv_transfer/staging.py) pass each stage of each layer, for
benchmarks/transfer_backends.py's P process: the host snapshot ready (`StagedBlocks.ready` returned: the copy to
the host done and the waiter's hand-off back to the loop), its CRC-32 summed (`StagedBlocks.checksum`, tcp), and
the layer's send returned (the data path's `send`: for tcp the frame handed to the socket and drained).

It wraps those methods in P's process only, timing around them (CLOCK_MONOTONIC): what runs is the backend's own
code. P sends one transfer at a time, so each stage's times are that transfer's layers in order; `parts` turns
them into `p_<stage>_first_ms` / `p_<stage>_last_ms` from the transfer's start and `p_<stage>_every_ms`, the
mean gap between layers: set beside D's `d_first_layer_ms` / `d_last_layer_ms`, where a layer's time goes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pdserve.kv_transfer.staging import StagedBlocks

STAGES = ("ready", "summed", "sent")


def _timed(method: Callable[..., Any], times: list[float]) -> Callable[..., Any]:
    async def timed(*args: Any, **kwargs: Any) -> Any:
        result = await method(*args, **kwargs)
        times.append(time.monotonic())
        return result
    return timed


def timed_stages(sender: object) -> dict[str, list[float]]:
    """Start timing the stages of `sender` (no stage of a sender without a staged data path: cuda_ipc)."""
    stages: dict[str, list[float]] = {name: [] for name in STAGES}
    path = getattr(sender, "path", None)
    if path is None:
        return stages
    StagedBlocks.ready = _timed(StagedBlocks.ready, stages["ready"])  # type: ignore[method-assign]
    StagedBlocks.checksum = _timed(StagedBlocks.checksum, stages["summed"])  # type: ignore[method-assign]
    path.send = _timed(path.send, stages["sent"])
    return stages


def parts(stages: dict[str, list[float]], t0: float) -> dict[str, float]:
    """One transfer's stage times (then cleared for the next) as ms from its start t0."""
    out = {}
    for name, times in stages.items():
        if times:
            times.sort()  # first and last in time: concurrent sends need not return in layer order
            out[f"p_{name}_first_ms"] = (times[0] - t0) * 1e3
            out[f"p_{name}_last_ms"] = (times[-1] - t0) * 1e3
            if len(times) > 1:
                out[f"p_{name}_every_ms"] = (times[-1] - times[0]) * 1e3 / (len(times) - 1)
        times.clear()
    return out
