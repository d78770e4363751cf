"""Moving KV blocks from prefill to decode workers: one interface, several backends, one wire format.

See base.py for the life of a transfer, wire.py for the frames, control/ for the control channel every backend
shares (handshake, auth, the target check, done / error / abort, deadlines) and registry.py for the backends,
one package each (`local`: same process and pool, no copy; `tcp`: the bytes on the control connection, any
host; `cuda_ipc`: P's kernels write into D's pool on the same host; `nccl`: the bytes through a two-rank
torch.distributed group, nccl on GPUs and gloo on CPUs; `store`: through a store both reach, no connection).
"""

from pdserve.kv_transfer.base import KVReceiver, KVSender, KVTransferError, PoolLayout
from pdserve.kv_transfer.local import LocalKVReceiver, LocalKVSender
from pdserve.kv_transfer.registry import KVBackend, backend_names, get_backend, register_backend
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from pdserve.kv_transfer.wire import FrameLimits, ProtocolError

__all__ = [
    "FrameLimits",
    "KVBackend",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "LocalKVReceiver",
    "LocalKVSender",
    "PoolLayout",
    "ProtocolError",
    "TcpKVReceiver",
    "TcpKVSender",
    "TransferTarget",
    "backend_names",
    "get_backend",
    "register_backend",
]
