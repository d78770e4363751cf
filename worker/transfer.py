"""A worker's KV transfer: the `TransferEnv` its settings give, and both sides built through the registry.

    TransferSettings ─▶ TransferEnv (device, secret, receiver address, model fingerprint; for `store` the shared
                        store, opened now: Redis is asked for its id, so a store nobody can reach stops the worker
                        at start with its URL in the message)
                     ─▶ get_backend(name).build_receiver(...)   decode role
                     ─▶ get_backend(name).build_sender(...)     prefill role (`local`: over that receiver)
"""

from __future__ import annotations

import torch

from pdserve.cache_store.shared_store import SharedStore, open_store
from pdserve.kv_transfer.registry import TransferEnv
from pdserve.settings import WorkerSettings

_MIN_TTL_S = 60


def transfer_env(settings: WorkerSettings, device: str, fingerprint: str, advertise_host: str) -> TransferEnv:
    """Values of the store transfer wait for D at most twice the KV lease (a reservation gives up after one)."""
    transfer = settings.transfer
    store: SharedStore | None = None
    if transfer.backend == "store":
        store = open_store(transfer.store, transfer.store_dir, settings.tiers.redis_url)
    return TransferEnv(device=torch.device(device), secret=settings.server.secret, host=transfer.host,
                       port=transfer.port, advertise_host=advertise_host, model_fingerprint=fingerprint, store=store,
                       chunk_bytes=transfer.chunk_bytes,
                       ttl_s=max(_MIN_TTL_S, int(2 * settings.scheduler.kv_lease_timeout_s)))
