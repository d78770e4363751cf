"""`nccl` KV transfer: P and D on any hosts (or GPUs without peer access); bytes through torch.distributed.

    D: NcclKVReceiver = the control server (kv_transfer/control/) + a TCPStore; expect(...) ─▶ TransferTarget{backend "nccl"}
    P: begin(target) ─▶ control connection: hello / auth (HMAC) / ready / rendezvous{backend, store, key}
       ─▶ both join a two-rank group through D's store (D rank 0, P rank 1)
       layer i done ─▶ gather blocks on P's device ─▶ "kv_bulk" header on the socket, group send of the blocks
    D: "kv_bulk" ─▶ checks ─▶ group recv into a buffer ─▶ scatter into pool[i];  "done" ─▶ on_complete

The group's backend follows the pool's device: "nccl" for CUDA pools (NVLink / PCIe / InfiniBand, whatever
NCCL finds), "gloo" for CPU pools, so the whole path runs and is tested on a machine without a GPU. Only
control frames cross the socket (msgpack, never pickle). See group.py for deadlines and for what is trusted.
"""

from pdserve.kv_transfer.nccl.group import GROUP_BACKENDS, PairGroup, group_backend
from pdserve.kv_transfer.nccl.receiver import NcclKVReceiver
from pdserve.kv_transfer.nccl.sender import NcclKVSender

__all__ = ["GROUP_BACKENDS", "NcclKVReceiver", "NcclKVSender", "PairGroup", "group_backend"]
