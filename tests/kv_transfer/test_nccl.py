"""nccl backend: a second process pushes KV through a real two-rank gloo group on CPU (bit-exact in this
process's pool), dead or stalled peers on either side end by the group's deadline instead of hanging, and
the registry / settings / CLI know the backend. The same transfer over NCCL between two GPUs is skipped
without them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kv_helpers import NUM_LAYERS, Outcomes, assert_dropped, make_pools
from nccl_peer import SECRET, SRC_BLOCKS, joined_client, sent_pools

from pdserve.kv_transfer import get_backend
from pdserve.kv_transfer.base import KVTransferError
from pdserve.kv_transfer.control.server import ConnectionPath, DataFrame
from pdserve.kv_transfer.nccl import NcclKVReceiver, NcclKVSender, group_backend
from pdserve.kv_transfer.nccl.receiver import GroupBytesIn
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.wire import BulkKVHeader, FrameLimits, encode_frame, write_frame
from pdserve.settings import TransferSettings
from pdserve.worker.flags import add_worker_arguments

HERE = Path(__file__).parent
GROUP_TIMEOUT_S = 1.5


def make_receiver(outcomes: Outcomes, pools: list[torch.Tensor] | None = None, cls: type = NcclKVReceiver,
                  group_timeout_s: float = GROUP_TIMEOUT_S) -> NcclKVReceiver:
    return cls("127.0.0.1", 0, pools if pools is not None else make_pools(), outcomes.on_complete,
               outcomes.on_failure, secret=SECRET, limits=FrameLimits(read_timeout_s=5.0),
               group_timeout_s=group_timeout_s)


async def run_peer(mode: str, device: str, targets: list[TransferTarget]) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE / "nccl_peer.py"), mode, device, json.dumps([t.to_dict() for t in targets]),
        cwd=HERE, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])},
        stderr=subprocess.PIPE)
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode or 0, stderr.decode()[-3000:]


async def serves_others(receiver: NcclKVReceiver, outcomes: Outcomes) -> None:
    sender = NcclKVSender("cpu", secret=SECRET)
    pools = make_pools(random=True)
    sender.begin(receiver.expect("bystander", [6], deadline=time.monotonic() + 10))
    for layer in range(NUM_LAYERS):
        await sender.send_layer("bystander", layer, pools[layer], [6], [6])
    await sender.finish("bystander", 1, None, 3)
    await outcomes.wait("bystander")
    assert "bystander" in outcomes.completed
    assert all(torch.equal(receiver.pools[i][:, 6], pools[i][:, 6]) for i in range(NUM_LAYERS))
    await sender.close()


def assert_landed(pools: list[torch.Tensor], dst_blocks: list[int], untouched: list[int]) -> None:
    sent = sent_pools()
    for layer in range(NUM_LAYERS):
        got = pools[layer].cpu()
        assert torch.equal(got[:, dst_blocks].view(torch.int16), sent[layer][:, SRC_BLOCKS].view(torch.int16))
        assert not got[:, untouched].any()


# ---- a real transfer -----------------------------------------------------------------------------------


async def _two_requests_from_another_process(device: str, pool_device: str) -> tuple[list[torch.Tensor], Outcomes]:
    outcomes = Outcomes()
    pools = [p.to(pool_device) for p in make_pools(torch.bfloat16)]
    receiver = make_receiver(outcomes, pools)
    await receiver.start()
    targets = [receiver.expect("r1", [7, 0, 3], deadline=time.monotonic() + 60, num_tokens=40),
               receiver.expect("r2", [4, 6, 1], deadline=time.monotonic() + 60, num_tokens=40)]
    rc, stderr = await run_peer("send", device, targets)
    assert rc == 0, stderr
    await outcomes.wait("r1")
    await outcomes.wait("r2")
    await receiver.close()
    return pools, outcomes


def test_another_process_pushes_two_requests_bit_exact_over_gloo() -> None:
    pools, outcomes = asyncio.run(_two_requests_from_another_process("cpu", "cpu"))
    assert outcomes.completed == {"r1": (5, -0.25), "r2": (5, -0.25)} and not outcomes.failed
    assert_landed(pools, [7, 0, 3], [2, 5])
    sent = sent_pools()
    assert all(torch.equal(pools[i][:, [4, 6, 1]].view(torch.int16), sent[i][:, SRC_BLOCKS].view(torch.int16))
               for i in range(NUM_LAYERS))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one GPU cannot be both ranks)")
def test_another_process_pushes_two_requests_bit_exact_over_nccl_between_two_gpus() -> None:
    assert group_backend(torch.device("cuda", 0)) == "nccl"
    pools, outcomes = asyncio.run(_two_requests_from_another_process("cuda:1", "cuda:0"))
    assert outcomes.completed == {"r1": (5, -0.25), "r2": (5, -0.25)} and not outcomes.failed
    assert_landed(pools, [7, 0, 3], [2, 5])


def test_registry_settings_and_cli_know_nccl() -> None:
    backend = get_backend("nccl")
    assert backend.sender is NcclKVSender and backend.receiver is NcclKVReceiver
    assert TransferSettings(backend="nccl").backend == "nccl"
    import argparse

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, "decode")
    assert parser.parse_args(["--transfer-backend", "nccl"]).transfer_backend == "nccl"
    assert group_backend(torch.device("cpu")) == "gloo"


# ---- dead and stalled peers ------------------------------------------------------------------------------


async def test_a_sender_that_never_joins_the_group_is_dropped_by_the_deadline() -> None:
    outcomes = Outcomes()
    receiver = make_receiver(outcomes)
    await receiver.start()
    reader, writer, _, _ = await joined_client(receiver, join=False)
    await assert_dropped(reader, within_s=GROUP_TIMEOUT_S + 3)
    writer.close()
    await serves_others(receiver, outcomes)
    await receiver.close()


async def test_a_stalled_sender_fails_its_request_by_the_deadline() -> None:
    outcomes = Outcomes()
    receiver = make_receiver(outcomes)
    await receiver.start()
    receiver.expect("victim", [3], deadline=None)
    reader, writer, _, _group = await joined_client(receiver)  # kept alive: a stalled peer, not a closed one
    header = BulkKVHeader("victim", 0, [3], "float32", [2, 1, 16, 2, 8], 2048)
    await write_frame(writer, encode_frame(header))  # ... and the bytes never come
    started = time.monotonic()
    await outcomes.wait("victim", timeout_s=GROUP_TIMEOUT_S + 3)
    assert time.monotonic() - started < GROUP_TIMEOUT_S + 3
    assert "did not complete" in outcomes.failed["victim"] or "Timed out" in outcomes.failed["victim"]
    await assert_dropped(reader)
    writer.close()
    await serves_others(receiver, outcomes)
    await receiver.close()


async def test_a_sender_process_that_dies_mid_layer_fails_its_request() -> None:
    outcomes = Outcomes()
    receiver = make_receiver(outcomes)
    await receiver.start()
    target = receiver.expect("victim", [3, 5], deadline=None)
    rc, stderr = await run_peer("die", "cpu", [target])
    assert rc == 3, stderr
    await outcomes.wait("victim", timeout_s=GROUP_TIMEOUT_S + 3)
    assert "gloo receive of 'victim' layer 0 (4096 bytes) failed" in outcomes.failed["victim"], outcomes.failed
    await serves_others(receiver, outcomes)
    await receiver.close()


async def test_closing_the_receiver_does_not_wait_for_a_pending_receive() -> None:
    outcomes = Outcomes()
    receiver = make_receiver(outcomes, group_timeout_s=30.0)
    await receiver.start()
    receiver.expect("victim", [3], deadline=None)
    _, writer, _, _ = await joined_client(receiver)
    await write_frame(writer, encode_frame(BulkKVHeader("victim", 0, [3], "float32", [2, 1, 16, 2, 8], 2048)))
    await asyncio.sleep(0.2)  # the receive is posted
    started = time.monotonic()
    await receiver.close()
    assert time.monotonic() - started < 2.0
    assert "receiver closed" in outcomes.failed["victim"]
    writer.close()


class StalledBytesIn(GroupBytesIn):
    async def receive(self, header: DataFrame, reader: asyncio.StreamReader) -> None:
        await self.receiver.wait(asyncio.sleep(3600))


class StalledReceiver(NcclKVReceiver):
    """A real receiver that stops receiving (a decode worker wedged mid-transfer): its sender must not hang."""

    async def open_path(self, writer: asyncio.StreamWriter) -> ConnectionPath:
        path = await super().open_path(writer)
        assert isinstance(path, GroupBytesIn)
        return StalledBytesIn(self, path.group)


async def test_a_receiver_that_stops_receiving_fails_finish_by_the_deadline() -> None:
    outcomes = Outcomes()
    receiver = make_receiver(outcomes, cls=StalledReceiver)
    await receiver.start()
    sender = NcclKVSender("cpu", secret=SECRET)
    pools = make_pools(random=True)
    sender.begin(receiver.expect("r1", [2], deadline=None))
    await sender.send_layer("r1", 0, pools[0], [2], [2])  # posted; the receiver never takes it
    started = time.monotonic()
    with pytest.raises(KVTransferError, match="1 layer sends failed"):
        await sender.finish("r1", 0, None, 3)
    assert time.monotonic() - started < 2 * GROUP_TIMEOUT_S + 3
    await sender.close()
    await receiver.close()
