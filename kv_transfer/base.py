"""The two sides of a KV transfer: `KVSender` on prefill workers, `KVReceiver` on decode workers.

    D: target = receiver.expect(request_id, reserved_block_ids, deadline)   ──JSON──▶  P
    P: sender.begin(target)
       once per forward:               sends = sender.prepare_sends(chunks)   (checks, device block ids)
       for each layer as it finishes:  sender.submit_prepared(sends, layer, kv_cache)   (compute thread)
                                    or sender.submit_layer(...)   (one request, from the compute thread)
                                    or await sender.send_layer(...) (from the event loop)
       await sender.finish(request_id, first_token_id, first_logprob, num_tokens, first_top)
    D: on_complete(request_id, first_token_id, first_logprob, first_top)   once every layer of every block arrived
       (first_top: P's top-k [(token id, logprob), ...] of the first token, [] when not asked for)
       on_failure(request_id, reason)   on a lease timeout, a broken connection or a bad frame;
                                        the node then frees the reserved blocks
    D: receiver.sender_lost(request_id, reason)   the router saw P go before the first token; a receiver that
                                        would not notice by itself (store: no connection to P) ends the
                                        transfer now if its KV did not land in full

Receivers call both callbacks on their event loop thread; each request gets exactly one of them, unless
the node `cancel`s it first (then neither).
"""

from __future__ import annotations

import concurrent.futures
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.cache_store.kv_codec import DTYPES
from pdserve.kernels.block_copy import scatter_blocks
from pdserve.kernels.host_copy import to_device
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.transfer_table import TransferTable
from pdserve.kv_transfer.wire import FrameLimits, dtype_name

OnComplete = Callable[[str, int, float | None, list[tuple[int, float]]], None]
OnFailure = Callable[[str, str], None]


def ids_on(device: torch.device, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Block ids as an int64 tensor on `device`, without waiting for the device (kernels/host_copy.py: a
    pageable copy waits for the stream, for P the layer being computed, for D's receiver the step in flight)."""
    if isinstance(block_ids, torch.Tensor):
        return block_ids
    return to_device(list(block_ids), torch.int64, device)


class KVTransferError(RuntimeError):
    """A send could not be completed (bad target, broken connection, failed layer send)."""


@dataclass(frozen=True)
class ChunkSend:
    """What one chunk of a forward pushes after every layer: our blocks `src` into the receiver's blocks `dst`."""

    request_id: str
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]


class PreparedSends:
    """One forward's sends, prepared once (`KVSender.prepare_sends`) and pushed after each layer
    (`KVSender.submit_prepared`). `failed` maps a request id to why its sends stopped; they stop for good."""

    def __init__(self, chunks: Sequence[ChunkSend]) -> None:
        self.chunks = list(chunks)
        self.failed: dict[str, str] = {}
        self.live_blocks = sum(len(c.src_block_ids) for c in self.chunks)  # blocks each layer sends

    def fail(self, request_id: str, reason: str) -> None:
        if request_id in self.failed:
            return
        self.failed[request_id] = reason
        self.live_blocks -= sum(len(c.src_block_ids) for c in self.chunks if c.request_id == request_id)

    def live(self) -> list[ChunkSend]:
        return [c for c in self.chunks if c.request_id not in self.failed]


@dataclass(frozen=True)
class PoolLayout:
    """Shape shared by the per-layer KV pools [2, num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, pools: Sequence[torch.Tensor]) -> PoolLayout:
        if not pools:
            raise ValueError("a KV receiver needs at least one layer pool")
        first = pools[0]
        if first.dim() != 5 or first.shape[0] != 2:
            raise ValueError(f"KV pool must be [2, blocks, block_size, Hkv, D], got {tuple(first.shape)}")
        for i, pool in enumerate(pools):
            if pool.shape != first.shape or pool.dtype != first.dtype or pool.device != first.device:
                raise ValueError(
                    f"layer {i} pool {tuple(pool.shape)} {pool.dtype} {pool.device} differs from layer 0's "
                    f"{tuple(first.shape)} {first.dtype} {first.device}"
                )
        dtype_name(first.dtype)  # raises for dtypes the wire cannot carry
        _, num_blocks, block_size, num_kv_heads, head_dim = first.shape
        return cls(len(pools), num_blocks, block_size, num_kv_heads, head_dim, first.dtype)

    def block_shape(self, num_blocks: int) -> list[int]:
        return [2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim]


class KVSender(ABC):
    """Pushes one request's KV blocks, layer by layer, to the receiver named by its TransferTarget."""

    # P and D hold one pool (`local`): P computes into D's reserved blocks and nothing is copied, so the prefill
    # node takes D's blocks instead of allocating its own and has no host/Redis tier lookup of its own to do
    shares_pool: bool = False

    @abstractmethod
    def begin(self, target: TransferTarget) -> None:
        """Start a transfer; call on the sender's event loop before any send for `target.request_id`."""

    @abstractmethod
    async def send_layer(
        self, request_id: str, layer: int, kv_cache: torch.Tensor,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> None:
        """Send blocks `src_block_ids` of this layer's pool to the receiver's `dst_block_ids`."""

    @abstractmethod
    def submit_layer(
        self, request_id: str, layer: int, kv_cache: torch.Tensor,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> concurrent.futures.Future[None]:
        """`send_layer` for a compute thread: the blocks are copied out before this returns, the
        network write happens on the sender's loop; the future resolves when it is written."""

    def prepare_sends(self, chunks: Sequence[ChunkSend]) -> PreparedSends:
        """Once per forward, on the compute thread, before its first layer: the work that is the same for every
        layer (checks, block ids on the device). A chunk that cannot be sent is already in `failed`."""
        return PreparedSends(chunks)

    def submit_prepared(self, sends: PreparedSends, layer: int, kv_cache: torch.Tensor) -> None:
        """`submit_layer` for this layer of every live chunk; a failure moves the request to `sends.failed`.
        Backends that prepare override both (cuda_ipc: one copy per receiver and layer)."""
        for chunk in sends.live():
            try:
                self.submit_layer(chunk.request_id, layer, kv_cache, chunk.src_block_ids, chunk.dst_block_ids)
            except KVTransferError as exc:
                sends.fail(chunk.request_id, str(exc))

    @abstractmethod
    async def finish(
        self, request_id: str, first_token_id: int, first_logprob: float | None, num_tokens: int,
        first_top: Sequence[tuple[int, float]] = (),
    ) -> None:
        """Wait for this request's layer sends, then tell the receiver the KV is complete."""

    @abstractmethod
    async def abort(self, request_id: str, reason: str) -> None:
        """Give a transfer up; the receiver releases its reservation."""

    async def close(self) -> None:
        """Release connections."""


class KVReceiver(ABC):
    """Accepts KV for reserved blocks into per-layer pools and reports each request's outcome."""

    backend: str
    # the sender writes into our pool itself (cuda_ipc): a request given up before its "done" keeps its blocks
    # until the sender's part ended (`release_after_sender`); elsewhere we write, and drop late frames
    remote_writes: bool = False
    limits: FrameLimits = FrameLimits()

    def __init__(self, pools: Sequence[torch.Tensor], on_complete: OnComplete, on_failure: OnFailure) -> None:
        self.pools = list(pools)
        self.layout = PoolLayout.of(self.pools)
        self.table = TransferTable(self.layout.num_layers, self.layout.block_size, on_complete, on_failure)

    def expect(
        self, request_id: str, block_ids: Sequence[int], deadline: float | None, num_tokens: int | None = None,
        first_block: int = 0,
    ) -> TransferTarget:
        """Register reserved blocks, for the prompt's blocks `first_block` on (the ones before are this side's
        cached prefix); `deadline` is a time.monotonic() instant (None: no lease).
        Call on the receiver's event loop."""
        bad = [b for b in block_ids if not 0 <= b < self.layout.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:5]} outside the pool's {self.layout.num_blocks} blocks")
        self.table.expect(request_id, block_ids, deadline, num_tokens)
        return TransferTarget(
            backend=self.backend, request_id=request_id, block_ids=tuple(block_ids),
            num_layers=self.layout.num_layers, block_size=self.layout.block_size,
            dtype=dtype_name(self.layout.dtype), first_block=first_block, **self._address(request_id),
        )

    def cancel(self, request_id: str) -> bool:
        """Forget a transfer without calling back (the node freed the request itself)."""
        return self.table.cancel(request_id)

    def release_after_sender(self, request_id: str, on_released: Callable[[str], None]) -> bool:
        """The node gives the request up. True: the sender may still write the reserved blocks, and
        `on_released(request_id)` comes once it cannot (its done or error, its connection lost, or its lease
        of silence); False: nothing to wait for, the transfer is cancelled and the blocks may be freed now."""
        if self.remote_writes and self.table.drain(request_id, on_released):
            return True
        self.cancel(request_id)
        return False

    def sender_lost(self, request_id: str, reason: str) -> None:
        """The router lost the request's sender before its first token. Backends on a connection to the sender
        see it close themselves; `store` has none and overrides this."""

    @property
    def num_pending(self) -> int:
        return len(self.table)

    def check_blocks(self, request_id: str, layer: int, block_ids: list[int], dtype: str, shape: list[int],
                     nbytes: int) -> str | None:
        """Why blocks announced by a header may not be read into the pool (None: they may): the checks of tcp's
        kv frames, which nccl's kv_bulk headers and store's kv_stored records pass too."""
        if request_id in self.table:
            problem = self.table.check_layer(request_id, layer, block_ids)
            if problem is not None:
                return problem
        elif not 0 <= layer < self.layout.num_layers or not 0 < len(block_ids) <= self.layout.num_blocks:
            return f"layer {layer} / {len(block_ids)} blocks outside the pool"
        if dtype not in DTYPES or dtype != dtype_name(self.layout.dtype):
            return f"dtype {dtype!r} is not the pool's {dtype_name(self.layout.dtype)}"
        expected_shape = self.layout.block_shape(len(block_ids))
        if shape != expected_shape:
            return f"shape {shape} != {expected_shape}"
        expected_nbytes = math.prod(expected_shape) * self.layout.dtype.itemsize
        if nbytes != expected_nbytes:
            return f"nbytes {nbytes} != {expected_nbytes} for shape {expected_shape}"
        if nbytes > self.limits.max_payload_bytes:
            return f"payload of {nbytes} bytes exceeds the {self.limits.max_payload_bytes} byte limit"
        return None

    def write_blocks(self, request_id: str, layer: int, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Scatter blocks [2, n, block_size, Hkv, D] that passed `check_blocks` into the pool, and record them."""
        pool = self.pools[layer]
        # from pinned memory the copy is queued (the host buffer is held by torch's pinned cache until it is done)
        blocks = blocks.to(pool.device, non_blocking=blocks.is_pinned())
        scatter_blocks(pool, ids_on(pool.device, block_ids), blocks)
        self.table.record_layer(request_id, layer, block_ids)

    async def start(self) -> None:
        """Begin accepting transfers."""

    async def close(self) -> None:
        """Stop; every pending transfer fails with reason "receiver closed"."""
        self.table.fail_all("receiver closed")

    def _address(self, request_id: str) -> dict[str, Any]:
        """Where the sender of this (just expected) request writes: the target's backend-specific fields."""
        return {}
