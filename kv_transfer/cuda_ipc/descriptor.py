"""D's KV pools as CUDA IPC handles: exported once by the receiver, sent in the "pools" frame, opened by P.

    D: export_pools(pools) ─▶ PoolDescriptor ─▶ to_bytes() ─▶ wire.Pools{descriptor}      (after auth + ready)
    P: PoolDescriptor.from_bytes(frame.descriptor) ─▶ open_pools(descriptor, P's device) ─▶ tensors over D's memory

Raw fields only, never a pickle: per layer the cudaIpcMemHandle of the allocation that holds the pool, the
pool's byte offset and size inside it, and torch's reference-counter file entry; for all layers the dtype,
the shape and the GPU's UUID (device indices differ between processes with different CUDA_VISIBLE_DEVICES).
A decoded descriptor is bounded before anything is opened: at most MAX_LAYERS layers, handles of at most
MAX_HANDLE_BYTES, a 5-dim [2, blocks, block_size, Hkv, D] shape whose bytes fit the shared storage.

Why torch's `UntypedStorage._new_shared_cuda` rather than cupy's `ipcOpenMemHandle`: torch is already
there on every worker (cupy would be a second CUDA library to install and to keep in step with the driver);
it caches the opened pointer per handle (a handle may be opened only once per context in an importing process,
so a reconnect to the same D reuses the mapping instead of failing), and the storage's deleter closes it and
releases D's counter. It opens the handle in the context of the device index it is given, with
cudaIpcMemLazyEnablePeerAccess: P passes its OWN device, so its copy kernels can store into D's pool whether D
sits on the same GPU or on a peer GPU of the same host (then over NVLink; the vLLM custom all-reduce pattern).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from pdserve.cache_store.kv_codec import DTYPES
from pdserve.kv_transfer.base import KVTransferError
from pdserve.kv_transfer.wire import dtype_name

DESCRIPTOR_VERSION = 1
MAX_LAYERS = 1024
MAX_HANDLE_BYTES = 256  # a cudaIpcMemHandle_t is 64 bytes; torch's expandable segments send a longer one
MAX_DESCRIPTOR_BYTES = 60 * 1024  # under wire.FrameLimits.max_header_bytes (64 KiB): 80 layers take ~14 KB
_EVENT_HANDLE = bytes(64)  # no IPC event: D synchronizes its device before exporting (see export_pools)


@dataclass(frozen=True)
class LayerHandle:
    handle: bytes  # cudaIpcMemHandle of the cudaMalloc block that holds this layer's pool
    storage_bytes: int  # size of the pool's storage
    storage_offset: int  # byte offset of that storage inside the block
    tensor_offset: int  # element offset of the pool inside its storage (0 for a fresh tensor)
    ref_counter: bytes  # torch's shared-memory file counting the importers (name, not a path to open)
    ref_counter_offset: int


@dataclass(frozen=True)
class PoolDescriptor:
    device_uuid: str
    dtype: str
    shape: tuple[int, ...]  # one layer's pool: [2, num_blocks, block_size, Hkv, D]
    layers: tuple[LayerHandle, ...]

    def to_bytes(self) -> bytes:
        layers = [[h.handle, h.storage_bytes, h.storage_offset, h.tensor_offset, h.ref_counter,
                   h.ref_counter_offset] for h in self.layers]
        raw: bytes = msgpack.packb({"version": DESCRIPTOR_VERSION, "device_uuid": self.device_uuid, "dtype": self.dtype,
                             "shape": list(self.shape), "layers": layers}, use_bin_type=True)
        if len(raw) > MAX_DESCRIPTOR_BYTES:
            raise KVTransferError(f"pool descriptor of {len(raw)} bytes exceeds {MAX_DESCRIPTOR_BYTES}")
        return raw

    @classmethod
    def from_bytes(cls, raw: bytes) -> PoolDescriptor:
        """Decode and bound a peer's descriptor; anything unexpected raises KVTransferError naming it."""
        if len(raw) > MAX_DESCRIPTOR_BYTES:
            raise KVTransferError(f"pool descriptor of {len(raw)} bytes exceeds {MAX_DESCRIPTOR_BYTES}")
        try:
            obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        except (ValueError, TypeError) as exc:
            raise KVTransferError(f"undecodable pool descriptor: {exc}") from None
        if not isinstance(obj, dict) or obj.get("version") != DESCRIPTOR_VERSION:
            raise KVTransferError(f"pool descriptor version must be {DESCRIPTOR_VERSION}")
        uuid, dtype, shape, layers = (obj.get(k) for k in ("device_uuid", "dtype", "shape", "layers"))
        if type(uuid) is not str or not 0 < len(uuid) <= 128:
            raise KVTransferError(f"pool descriptor device_uuid must be a short string, got {uuid!r}")
        if dtype not in DTYPES:
            raise KVTransferError(f"pool descriptor dtype {dtype!r} is not one of {sorted(DTYPES)}")
        if (type(shape) is not list or len(shape) != 5 or shape[0] != 2
                or not all(type(n) is int and n > 0 for n in shape)):
            raise KVTransferError(f"pool descriptor shape must be [2, blocks, block_size, Hkv, D], got {shape!r}")
        if type(layers) is not list or not 0 < len(layers) <= MAX_LAYERS:
            raise KVTransferError(f"pool descriptor must hold 1..{MAX_LAYERS} layers")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        handles = tuple(_layer(entry, i, nbytes, DTYPES[dtype].itemsize) for i, entry in enumerate(layers))
        return cls(uuid, dtype, tuple(shape), handles)


def _layer(entry: Any, index: int, pool_bytes: int, itemsize: int) -> LayerHandle:
    kinds = (bytes, int, int, int, bytes, int)
    if type(entry) is not list or len(entry) != len(kinds) or any(
            type(v) is not k for v, k in zip(entry, kinds, strict=True)):
        raise KVTransferError(f"pool descriptor layer {index} must be [handle, size, offset, tensor offset, "
                              f"counter, counter offset] of bytes/ints")
    handle, size, offset, tensor_offset, counter, counter_offset = entry
    if not 0 < len(handle) <= MAX_HANDLE_BYTES or not 0 < len(counter) <= MAX_HANDLE_BYTES:
        raise KVTransferError(f"pool descriptor layer {index}: handles must be 1..{MAX_HANDLE_BYTES} bytes")
    if min(size, offset, tensor_offset, counter_offset) < 0 or tensor_offset * itemsize + pool_bytes > size:
        raise KVTransferError(f"pool descriptor layer {index}: a {pool_bytes}-byte pool at element "
                              f"{tensor_offset} does not fit a {size}-byte storage")
    return LayerHandle(handle, size, offset, tensor_offset, counter, counter_offset)


def require_cuda(what: str, device: torch.device) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise KVTransferError(f"the cuda_ipc KV transfer backend needs CUDA: {what} is on {device} and "
                              f"torch.cuda.is_available() is {torch.cuda.is_available()}; use --transfer-backend tcp")


def device_uuid(device: torch.device) -> str:
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
    if not uuid:
        raise KVTransferError(f"torch {torch.__version__} reports no UUID for {device}: cuda_ipc cannot tell GPUs apart")
    return uuid


def export_pools(pools: Sequence[torch.Tensor]) -> PoolDescriptor:
    """D's side. Shares each pool's storage once (torch.multiprocessing's reduce_tensor, whose raw fields are
    kept and whose pickle-ready rebuild function is not)."""
    from torch.multiprocessing.reductions import reduce_tensor

    first = pools[0]
    require_cuda("the decode worker's KV pool", first.device)
    # The pools' zero fill must be done before a peer writes: one sync here instead of an IPC event per layer.
    torch.cuda.synchronize(first.device)
    layers = []
    for i, pool in enumerate(pools):
        if not pool.is_contiguous():
            raise KVTransferError(f"layer {i}'s KV pool is not contiguous (strides {pool.stride()})")
        rebuild, args = reduce_tensor(pool)
        if rebuild.__name__ != "rebuild_cuda_tensor" or len(args) != 15:
            raise KVTransferError(f"torch {torch.__version__} changed reduce_tensor's CUDA fields "
                                  f"({rebuild.__name__}, {len(args)} args): cuda_ipc needs updating")
        fields: tuple[Any, ...] = tuple(args)
        tensor_offset, handle, size, offset, counter, counter_offset = (fields[3], *fields[7:10], *fields[11:13])
        layers.append(LayerHandle(handle, size, offset, tensor_offset, counter, counter_offset))
    return PoolDescriptor(device_uuid(first.device), dtype_name(first.dtype), tuple(first.shape), tuple(layers))


def local_index(uuid: str) -> int:
    """This process's index of the GPU with that UUID."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == uuid:
            return index
    raise KVTransferError(f"the decode worker's GPU {uuid} is not visible to this process "
                          f"({torch.cuda.device_count()} visible; check CUDA_VISIBLE_DEVICES): cuda_ipc needs both "
                          f"on one host")


def check_peer_access(index: int, peer: int) -> None:
    """P's GPU `index` must be able to store into D's GPU `peer` (same GPU, or P2P over NVLink / PCIe). Peer
    access itself is then enabled by the open (cudaIpcMemLazyEnablePeerAccess), for these mappings only."""
    if peer != index and not torch.cuda.can_device_access_peer(index, peer):
        raise KVTransferError(f"cuda:{index} (the prefill worker's GPU) cannot access peer cuda:{peer} (the decode "
                              f"worker's GPU): no P2P between them, so cuda_ipc cannot write into its pool; use "
                              f"--transfer-backend nccl (NCCL moves the KV through host memory or the network "
                              f"then) or tcp")


def open_pools(descriptor: PoolDescriptor, device: torch.device) -> list[torch.Tensor]:
    """P's side: D's pools as tensors P's kernels on `device` can write (see the module docstring)."""
    require_cuda("the prefill worker's KV pool", device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    check_peer_access(index, local_index(descriptor.device_uuid))
    dtype, shape = DTYPES[descriptor.dtype], descriptor.shape
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    pools = []
    for layer in descriptor.layers:
        storage = torch.UntypedStorage._new_shared_cuda(
            index, layer.handle, layer.storage_bytes, layer.storage_offset, layer.ref_counter,
            layer.ref_counter_offset, _EVENT_HANDLE, False,
        )
        tensor = torch.empty((0,), dtype=dtype, device=torch.device("cuda", index))
        pools.append(tensor.set_(storage, layer.tensor_offset, shape, strides))
    return pools
