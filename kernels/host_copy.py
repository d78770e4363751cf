"""Host values to a device tensor without synchronizing the host with the device.

`torch.tensor(values, device="cuda")` copies from pageable memory, and torch makes that copy blocking: the
host waits for everything already queued on the stream. Inside a decode step that is the previous step's
forward (about 5 ms of llama3-8b on the H200), so one such call per step undoes the overlapped loop
(decode_node/engine.py). Here the values go through pinned memory and are copied non_blocking; torch's pinned
allocator does not hand the block out again until the copy has completed, so the host tensor may be dropped at
once. On the CPU it is the plain tensor. Here, below every package, so that the engine, the cache tiers and the
KV receivers share it (a tier's block ids, a received layer's: each would otherwise wait for the step in flight).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[float] | Sequence[int] | Sequence[bool], dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
