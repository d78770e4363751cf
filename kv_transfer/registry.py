"""Backend name (from the config) → its sender and receiver, and how to build each side.

Constructors differ per backend (`local` shares the receiver object, `tcp` takes an address, `store` a shared
store), so each backend registers two builders over one `TransferEnv`: what a worker knows that a backend may
need. The worker (worker/transfer.py) and the benchmarks build both sides through them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pdserve.cache_store.shared_store import SharedStore
from pdserve.kv_transfer.base import KVReceiver, KVSender, OnComplete, OnFailure
from pdserve.kv_transfer.control.server import ListeningReceiver
from pdserve.kv_transfer.cuda_ipc import CudaIpcKVReceiver, CudaIpcKVSender
from pdserve.kv_transfer.local import LocalKVReceiver, LocalKVSender
from pdserve.kv_transfer.nccl import NcclKVReceiver, NcclKVSender
from pdserve.kv_transfer.store import StoreKVReceiver, StoreKVSender
from pdserve.kv_transfer.tcp import TcpKVReceiver, TcpKVSender


@dataclass(frozen=True)
class TransferEnv:
    """What building a backend's sides may take: the pool's device, the deployment's secret, where a receiver
    listens (tcp, cuda_ipc, nccl), and for `store` the shared store with its chunk size and values' TTL."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    secret: str | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    advertise_host: str | None = None
    model_fingerprint: str = ""
    store: SharedStore | None = None
    chunk_bytes: int = 4 << 20
    ttl_s: int = 300


SenderBuilder = Callable[[TransferEnv, KVReceiver | None], KVSender]  # (env, this worker's receiver: local's)
ReceiverBuilder = Callable[[TransferEnv, Sequence[torch.Tensor], OnComplete, OnFailure], KVReceiver]


@dataclass(frozen=True)
class KVBackend:
    name: str
    sender: type[KVSender]
    receiver: type[KVReceiver]
    build_sender: SenderBuilder
    build_receiver: ReceiverBuilder

    @property
    def shares_pool(self) -> bool:
        """P and D over one pool (`local`): a worker builds only its own roles, and P copies nothing."""
        return self.sender.shares_pool


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


# ---- the builders ---------------------------------------------------------------------------------------

def _local_sender(env: TransferEnv, receiver: KVReceiver | None) -> KVSender:
    if not isinstance(receiver, LocalKVReceiver):
        raise TypeError("the local backend's sender needs the worker's own local receiver (--role both)")
    return LocalKVSender(receiver)


def _local_receiver(env: TransferEnv, pools: Sequence[torch.Tensor], on_complete: OnComplete,
                    on_failure: OnFailure) -> KVReceiver:
    return LocalKVReceiver(pools, on_complete, on_failure)


def _listening(cls: type[ListeningReceiver]) -> ReceiverBuilder:
    def build(env: TransferEnv, pools: Sequence[torch.Tensor], on_complete: OnComplete,
              on_failure: OnFailure) -> KVReceiver:
        return cls(env.host, env.port, pools, on_complete, on_failure, secret=env.secret,
                   advertise_host=env.advertise_host)
    return build


def _store(env: TransferEnv) -> SharedStore:
    if env.store is None:
        raise ValueError("the store backend needs a shared store (--transfer-store shm or redis)")
    return env.store


def _store_sender(env: TransferEnv, receiver: KVReceiver | None) -> KVSender:
    return StoreKVSender(_store(env), secret=env.secret, model_fingerprint=env.model_fingerprint,
                         chunk_bytes=env.chunk_bytes, ttl_s=env.ttl_s)


def _store_receiver(env: TransferEnv, pools: Sequence[torch.Tensor], on_complete: OnComplete,
                    on_failure: OnFailure) -> KVReceiver:
    return StoreKVReceiver(pools, on_complete, on_failure, store=_store(env), secret=env.secret,
                           model_fingerprint=env.model_fingerprint, expire_after_s=env.ttl_s)


register_backend(KVBackend("local", LocalKVSender, LocalKVReceiver, _local_sender, _local_receiver))
register_backend(KVBackend("tcp", TcpKVSender, TcpKVReceiver, lambda env, _: TcpKVSender(secret=env.secret),
                           _listening(TcpKVReceiver)))
register_backend(KVBackend("cuda_ipc", CudaIpcKVSender, CudaIpcKVReceiver,
                           lambda env, _: CudaIpcKVSender(env.device, secret=env.secret), _listening(CudaIpcKVReceiver)))
register_backend(KVBackend("nccl", NcclKVSender, NcclKVReceiver,
                           lambda env, _: NcclKVSender(env.device, secret=env.secret), _listening(NcclKVReceiver)))
register_backend(KVBackend("store", StoreKVSender, StoreKVReceiver, _store_sender, _store_receiver))
