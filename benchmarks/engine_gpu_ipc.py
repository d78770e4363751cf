"""cuda_ipc transfer timing for benchmarks/engine_gpu.py: D is the calling process (run_receiver), P a child
process (`python engine_gpu_ipc.py prefill SPEC`) that pushes every layer of `blocks` blocks into D's pool,
`repeat` times after one warm-up, alternating between two halves of both pools, and prints one JSON line.

Per transfer P reports two times. gpu_ms: its launches queued behind a ~50 ms spin kernel, the span from
the spin's end to the last copy's end on the transfer stream, i.e. what the copies themselves take (what
prefill compute hides layer by layer). wall_ms: first send -> finish returned, launches paced by Python.
D checks that the last transfer's blocks hold P's values.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from pdserve.engine.config import ModelConfig
from pdserve.kv_transfer.cuda_ipc import CudaIpcKVReceiver, CudaIpcKVSender
from pdserve.kv_transfer.target import TransferTarget

BLOCK_SIZE = 16
SECRET = "engine-gpu-benchmark"
_SPIN_CYCLES = 100_000_000  # ~50 ms at the H200's 1.98 GHz: far longer than enqueuing 32 layers (~7 ms)


def pool_shape(config: ModelConfig, blocks: int) -> tuple[int, int, int, int, int]:
    return (2, blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)


async def run_receiver(config: ModelConfig, blocks: int, repeat: int, device: torch.device) -> dict[str, float]:
    pools = [torch.zeros(pool_shape(config, 2 * blocks), dtype=torch.bfloat16, device=device)
             for _ in range(config.num_layers)]
    completed: list[str] = []
    failed: list[str] = []
    receiver = CudaIpcKVReceiver("127.0.0.1", 0, pools, lambda rid, *_: completed.append(rid),
                                 lambda rid, why: failed.append(f"{rid}: {why}"), secret=SECRET)
    await receiver.start()
    halves = [list(range(blocks)), list(range(blocks, 2 * blocks))]
    targets = [receiver.expect(f"r{i}", halves[i % 2], deadline=None).to_dict() for i in range(2 * (repeat + 1))]
    spec = {"targets": targets, "blocks": blocks, "layers": config.num_layers, "shape": pool_shape(config, 2 * blocks),
            "device": str(device)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).resolve()), "prefill", json.dumps(spec),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), timeout=300)
    await asyncio.sleep(0.2)  # the last "done" frames reach the receiver
    await receiver.close()
    if process.returncode != 0 or failed or len(completed) != len(targets):
        raise RuntimeError(f"cuda_ipc transfer failed: rc {process.returncode}, {len(completed)}/{len(targets)} "
                           f"completed, {failed[:2]}, {err.decode()[-2000:]}")
    last = halves[(len(targets) - 1) % 2]
    for layer in (0, config.num_layers - 1):
        if not bool((pools[layer][:, last] == layer + 1).all()):
            raise RuntimeError(f"cuda_ipc transfer: layer {layer} of D's pool does not hold P's blocks")
    return json.loads(out.decode().strip().splitlines()[-1])


async def _push(sender: CudaIpcKVSender, target: TransferTarget, pools: list[torch.Tensor], src: list[int],
                timed_gpu: bool) -> float:
    sender.begin(target)
    start = end = None
    if timed_gpu:
        torch.cuda._sleep(_SPIN_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for layer, pool in enumerate(pools):
        await sender.send_layer(target.request_id, layer, pool, src, list(target.block_ids))
    if end is not None:
        end.record(sender.transfer_stream)
    enqueue = (time.perf_counter() - t0) * 1e3
    await sender.finish(target.request_id, 0, None, len(src) * BLOCK_SIZE)
    wall = (time.perf_counter() - t0) * 1e3
    if start is not None and end is not None:
        return start.elapsed_time(end), enqueue
    return wall, enqueue


async def prefill_side(spec: dict) -> dict[str, float]:
    device = torch.device(spec["device"])
    pools = [torch.full(spec["shape"], layer + 1, dtype=torch.bfloat16, device=device) for layer in range(spec["layers"])]
    sender = CudaIpcKVSender(device, secret=SECRET)
    blocks = spec["blocks"]
    halves = [list(range(blocks)), list(range(blocks, 2 * blocks))]
    gpu, wall, enqueued_behind_spin = [], [], []
    for i, raw in enumerate(spec["targets"]):
        torch.cuda.synchronize(device)
        ms, enqueue = await _push(sender, TransferTarget.from_dict(raw), pools, halves[(i + 1) % 2],
                                  timed_gpu=i % 2 == 0)
        if i >= 2:  # the first pair warms up (handshake, Triton compile)
            (gpu if i % 2 == 0 else wall).append(ms)
            if i % 2 == 0:
                enqueued_behind_spin.append(enqueue)
    await sender.close()
    # gpu_ms is the copies' own time only if every launch was queued before the spin ended (~50 ms)
    return {"gpu_ms": statistics.median(gpu), "wall_ms": statistics.median(wall),
            "enqueue_ms_max": max(enqueued_behind_spin)}


if __name__ == "__main__" and sys.argv[1:2] == ["prefill"]:
    print(json.dumps(asyncio.run(prefill_side(json.loads(sys.argv[2])))))
