"""Backend name (from the config) → sender and receiver classes.

Constructors differ per backend (`local` shares the receiver object, `tcp` takes an address), so the
registry hands out classes and the node that owns the config builds them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kv_transfer.base import KVReceiver, KVSender
from pdserve.kv_transfer.cuda_ipc import CudaIpcKVReceiver, CudaIpcKVSender
from pdserve.kv_transfer.local import LocalKVReceiver, LocalKVSender
from pdserve.kv_transfer.nccl import NcclKVReceiver, NcclKVSender
from pdserve.kv_transfer.tcp_receiver import TcpKVReceiver
from pdserve.kv_transfer.tcp_sender import TcpKVSender


@dataclass(frozen=True)
class KVBackend:
    name: str
    sender: type[KVSender]
    receiver: type[KVReceiver]


_BACKENDS: dict[str, KVBackend] = {}


def register_backend(backend: KVBackend) -> None:
    if backend.name in _BACKENDS:
        raise ValueError(f"KV transfer backend {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend


def get_backend(name: str) -> KVBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; choose one of {backend_names()}")
    return _BACKENDS[name]


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


register_backend(KVBackend("local", LocalKVSender, LocalKVReceiver))
register_backend(KVBackend("tcp", TcpKVSender, TcpKVReceiver))
register_backend(KVBackend("cuda_ipc", CudaIpcKVSender, CudaIpcKVReceiver))
register_backend(KVBackend("nccl", NcclKVSender, NcclKVReceiver))
