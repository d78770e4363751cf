"""cuda_ipc: the pool descriptor's msgpack round trip and bounds, the registry entry, the errors without CUDA,
the copy's id tensors compiling one kernel for any block count (all on CPU); on a GPU (skipped elsewhere), a
second process writes 3 layers into this process's pool, one request at a time and two prepared together."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch
from kv_helpers import NUM_LAYERS, Outcomes, make_pools

from pdserve.kv_transfer import get_backend
from pdserve.kv_transfer.base import KVTransferError
from pdserve.kv_transfer.cuda_ipc import CudaIpcKVReceiver, CudaIpcKVSender, LayerHandle, PoolDescriptor
from pdserve.kv_transfer.cuda_ipc.descriptor import MAX_DESCRIPTOR_BYTES, MAX_LAYERS, check_peer_access
from pdserve.kv_transfer.cuda_ipc.sender import device_block_ids
from pdserve.kv_transfer.wire import Pools, decode_header, encode_frame
from pdserve.settings import TransferSettings

SHAPE = (2, 8, 16, 2, 8)
POOL_BYTES = 2 * 8 * 16 * 2 * 8 * 2  # bfloat16


def descriptor(num_layers: int = 3) -> PoolDescriptor:
    layers = tuple(LayerHandle(bytes([i]) * 64, POOL_BYTES + 512, 512 * i, 0, b"/torch_123_456", i)
                   for i in range(num_layers))
    return PoolDescriptor("GPU-8a1b-uuid", "bfloat16", SHAPE, layers)


def raw(**changes: object) -> bytes:
    obj = msgpack.unpackb(descriptor().to_bytes(), raw=False)
    obj.update(changes)
    return msgpack.packb(obj, use_bin_type=True)


def test_descriptor_round_trips_through_the_pools_frame() -> None:
    sent = descriptor(80)  # Llama-3-70B's layer count
    frame = b"".join(bytes(b) for b in encode_frame(Pools(sent.to_bytes())))
    header = decode_header(frame[4:])
    assert isinstance(header, Pools)
    assert PoolDescriptor.from_bytes(header.descriptor) == sent
    assert len(sent.to_bytes()) < MAX_DESCRIPTOR_BYTES


@pytest.mark.parametrize("blob,message", [
    (b"\xc1", "undecodable"),
    (raw(version=2), "version must be 1"),
    (raw(dtype="int64"), "dtype 'int64'"),
    (raw(shape=[2, 8, 16, 2]), "shape must be"),
    (raw(shape=[3, 8, 16, 2, 8]), "shape must be"),
    (raw(shape=[2, 8, 16, True, 8]), "shape must be"),
    (raw(layers=[]), "1..1024 layers"),
    (raw(device_uuid=""), "device_uuid"),
    (raw(layers=[[b"h" * 64, 10, 0, 0, b"c", 0]]), "does not fit a 10-byte storage"),
    (raw(layers=[[b"h" * 300, POOL_BYTES, 0, 0, b"c", 0]]), "handles must be 1..256 bytes"),
    (raw(layers=[[b"h" * 64, POOL_BYTES, 0, 0, "c", 0]]), "bytes/ints"),
    (raw(layers=[[b"h" * 64, POOL_BYTES, -1, 0, b"c", 0]]), "does not fit"),
    (raw(layers=[[b"h" * 64, POOL_BYTES, 0, 0, b"c", 0]] * (MAX_LAYERS + 1)), "exceeds"),
])
def test_descriptor_refuses(blob: bytes, message: str) -> None:
    with pytest.raises(KVTransferError, match=message):
        PoolDescriptor.from_bytes(blob)


def test_registry_and_settings_know_cuda_ipc() -> None:
    backend = get_backend("cuda_ipc")
    assert backend.sender is CudaIpcKVSender and backend.receiver is CudaIpcKVReceiver
    assert TransferSettings(backend="cuda_ipc").backend == "cuda_ipc"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without CUDA gives")
def test_without_cuda_both_sides_say_why() -> None:
    with pytest.raises(KVTransferError, match="cuda_ipc KV transfer backend needs CUDA.*use --transfer-backend tcp"):
        CudaIpcKVSender("cpu")
    with pytest.raises(KVTransferError, match="decode worker's KV pool is on cpu"):
        CudaIpcKVReceiver("127.0.0.1", 0, make_pools(), lambda *a: None, lambda *a: None)


def test_copy_ids_compile_one_kernel_for_any_block_count() -> None:
    """The dst row of the [2, n] id tensor starts 16-byte aligned for odd n too, so the copy kernel's launch key
    is the same for 1..9 blocks (an unpadded row 1 is 8-byte aligned at odd n: a second compile)."""
    from pdserve.kernels.block_copy_triton import copy_blocks_triton
    from pdserve.kernels.specialization import LaunchRecorder

    meta = torch.device("meta")
    ours, theirs = torch.empty(2, 64, 16, 8, 128, device=meta), torch.empty(2, 96, 16, 8, 128, device=meta)
    with LaunchRecorder(run=False) as recorder:
        for n in range(1, 10):
            src, dst = device_block_ids(list(range(n)), list(range(n, 2 * n)), meta)
            copy_blocks_triton(ours, src, theirs, dst)
    assert recorder.launches == 9 and len(recorder.keys) == 1
    src, dst = device_block_ids([3, 1, 2], [7, 0, 5], torch.device("cpu"))
    assert src.tolist() == [3, 1, 2] and dst.tolist() == [7, 0, 5] and dst.data_ptr() % 16 == 0


_PREFILL_PROCESS = """
import asyncio, json, sys, threading
import torch
from kv_helpers import make_pools
from pdserve.kv_transfer.cuda_ipc import CudaIpcKVSender
from pdserve.kv_transfer.target import TransferTarget

async def main(target, device):
    pools = [p.to(device) for p in make_pools(torch.bfloat16, random=True, seed=7)]
    sender = CudaIpcKVSender(device, secret="s3cret")
    sender.begin(target)
    thread = threading.Thread(target=lambda: [sender.submit_layer("r1", layer, pools[layer], [1, 2, 5], [7, 0, 3])
                                              for layer in (0, 1)])
    thread.start()
    await asyncio.to_thread(thread.join)
    await sender.send_layer("r1", 2, pools[2], [1, 2, 5], [7, 0, 3])
    await sender.finish("r1", 5, -0.25, 40)
    await sender.close()

asyncio.run(main(TransferTarget.from_dict(json.loads(sys.argv[1])), sys.argv[2]))
"""


_PREPARED_PROCESS = """
import asyncio, json, sys, threading
import torch
from kv_helpers import make_pools
from pdserve.kv_transfer.base import ChunkSend
from pdserve.kv_transfer.cuda_ipc import CudaIpcKVSender
from pdserve.kv_transfer.target import TransferTarget

async def main(targets, device):
    pools = [p.to(device) for p in make_pools(torch.bfloat16, random=True, seed=7)]
    sender = CudaIpcKVSender(device, secret="s3cret")
    for target in targets:
        sender.begin(target)

    def forward():  # one forward of both requests: prepared once, one copy per layer
        sends = sender.prepare_sends([ChunkSend("r1", (1, 2, 5), (7, 0, 3)), ChunkSend("r2", (4,), (6,))])
        for layer in range(3):
            sender.submit_prepared(sends, layer, pools[layer])
        assert not sends.failed, sends.failed

    thread = threading.Thread(target=forward)
    thread.start()
    await asyncio.to_thread(thread.join)
    await sender.finish("r1", 5, -0.25, 40)
    await sender.finish("r2", 6, None, 10)
    await sender.close()

asyncio.run(main([TransferTarget.from_dict(t) for t in json.loads(sys.argv[1])], sys.argv[2]))
"""


async def _other_process_writes(device: str, prepared: bool = False) -> tuple[list[torch.Tensor], Outcomes]:
    outcomes = Outcomes()
    pools = [p.cuda() for p in make_pools(torch.bfloat16)]
    receiver = CudaIpcKVReceiver("127.0.0.1", 0, pools, outcomes.on_complete, outcomes.on_failure, secret="s3cret")
    await receiver.start()
    targets = [receiver.expect("r1", [7, 0, 3], deadline=None, num_tokens=40)]
    if prepared:
        targets.append(receiver.expect("r2", [6], deadline=None, num_tokens=10))
    arg = json.dumps([t.to_dict() for t in targets] if prepared else targets[0].to_dict())
    here = Path(__file__).parent
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _PREPARED_PROCESS if prepared else _PREFILL_PROCESS, arg, device, cwd=here,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}, stderr=subprocess.PIPE)
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0, stderr.decode()[-3000:]
    for target in targets:
        await outcomes.wait(target.request_id)
    await receiver.close()
    return pools, outcomes


def _devices() -> list[str]:
    if not torch.cuda.is_available():
        return ["cuda:0"]
    return ["cuda:0"] + (["cuda:1"] if torch.cuda.device_count() > 1 else [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
@pytest.mark.parametrize("prefill_device", _devices())
def test_a_second_process_writes_three_layers_into_this_pool(prefill_device: str) -> None:
    pools, outcomes = asyncio.run(_other_process_writes(prefill_device))
    assert outcomes.completed == {"r1": (5, -0.25)} and not outcomes.failed
    sent = make_pools(torch.bfloat16, random=True, seed=7)
    for layer in range(NUM_LAYERS):
        got = pools[layer].cpu()
        assert torch.equal(got[:, [7, 0, 3]].view(torch.int16), sent[layer][:, [1, 2, 5]].view(torch.int16))
        assert not got[:, [1, 2, 4, 5, 6]].any()


def test_gpus_without_peer_access_name_the_nccl_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand-in for a host whose GPUs have no P2P (this machine has no GPU): the answer torch would give."""
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda index, peer: False)
    check_peer_access(1, 1)  # one GPU: nothing to ask
    with pytest.raises(KVTransferError, match=r"cuda:0 .* cannot access peer cuda:1 .*--transfer-backend nccl"):
        check_peer_access(0, 1)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda index, peer: True)
    check_peer_access(0, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_two_requests_prepared_together_land_in_their_blocks() -> None:
    pools, outcomes = asyncio.run(_other_process_writes("cuda:0", prepared=True))
    assert outcomes.completed == {"r1": (5, -0.25), "r2": (6, None)} and not outcomes.failed
    sent = make_pools(torch.bfloat16, random=True, seed=7)
    for layer in range(NUM_LAYERS):
        got = pools[layer].cpu()
        assert torch.equal(got[:, [7, 0, 3, 6]].view(torch.int16), sent[layer][:, [1, 2, 5, 4]].view(torch.int16))
        assert not got[:, [1, 2, 4, 5]].any()


_ABORTING_PROCESS = """
import asyncio, json, sys, threading, time
import torch
from kv_helpers import make_pools
from pdserve.kv_transfer.cuda_ipc import CudaIpcKVSender
from pdserve.kv_transfer.target import TransferTarget

async def main(target, device):
    pools = [p.to(device) for p in make_pools(torch.bfloat16, random=True, seed=9)]
    sender = CudaIpcKVSender(device, secret="s3cret")
    sender.begin(target)
    submit = lambda layers: [sender.submit_layer("r1", layer, pools[layer], [1, 2, 5], [7, 0, 3]) for layer in layers]
    await asyncio.to_thread(submit, [0])
    print("layer 0 written", flush=True)
    await asyncio.sleep(0.3)  # D aborts the request meanwhile
    await asyncio.to_thread(submit, [1, 2])  # copies of a request D gave up: they land in its held blocks
    print(f"last copy enqueued {time.monotonic()}", flush=True)
    await sender.abort("r1", "aborted mid-transfer")  # waits for its copies, then the "error" frame
    await sender.close()

asyncio.run(main(TransferTarget.from_dict(json.loads(sys.argv[1])), sys.argv[2]))
"""


async def _abort_mid_transfer(device: str) -> tuple[list[torch.Tensor], float, float, Outcomes]:
    outcomes = Outcomes()
    pools = [p.cuda() for p in make_pools(torch.bfloat16)]
    receiver = CudaIpcKVReceiver("127.0.0.1", 0, pools, outcomes.on_complete, outcomes.on_failure, secret="s3cret")
    await receiver.start()
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    target = receiver.expect("r1", [7, 0, 3], deadline=None, num_tokens=40)
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", _ABORTING_PROCESS,
                                                   json.dumps(target.to_dict()), device, cwd=here, env=env,
                                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None
    assert (await asyncio.wait_for(process.stdout.readline(), 60)).startswith(b"layer 0 written")
    released = asyncio.get_running_loop().create_future()
    held = receiver.release_after_sender("r1", lambda rid: released.set_result(time.monotonic()))
    assert held, "a cuda_ipc receiver must hold the blocks of a request its sender may still write"
    last_copy = float((await asyncio.wait_for(process.stdout.readline(), 60)).split()[-1])
    released_at = await asyncio.wait_for(released, 30)
    _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode()[-3000:]
    # the blocks, released, go to a new request: a second process writes its own KV into them
    second = receiver.expect("r2", [7, 0, 3], deadline=None, num_tokens=40)
    writer = await asyncio.create_subprocess_exec(sys.executable, "-c", _PREFILL_PROCESS.replace('"r1"', '"r2"'),
                                                  json.dumps(second.to_dict()), device, cwd=here, env=env,
                                                  stderr=subprocess.PIPE)
    _, stderr = await asyncio.wait_for(writer.communicate(), 120)
    assert writer.returncode == 0, stderr.decode()[-3000:]
    await outcomes.wait("r2")
    await receiver.close()
    return pools, last_copy, released_at, outcomes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_an_aborted_request_keeps_its_blocks_until_the_senders_copies_landed() -> None:
    """Issue 16's race on cuda_ipc: D gives r1 up after P's first layer, P goes on writing two more layers into
    r1's blocks, then gives up too. D releases the blocks only after P's "error" (so after those copies), and the
    request reserved on them next holds exactly its own KV."""
    pools, last_copy, released_at, outcomes = asyncio.run(_abort_mid_transfer("cuda:0"))
    assert released_at > last_copy, "the blocks were released before the sender's last copy was enqueued"
    assert outcomes.completed == {"r2": (5, -0.25)} and not outcomes.failed
    mine = make_pools(torch.bfloat16, random=True, seed=7)
    for layer in range(NUM_LAYERS):
        got = pools[layer].cpu()
        assert torch.equal(got[:, [7, 0, 3]].view(torch.int16), mine[layer][:, [1, 2, 5]].view(torch.int16))
