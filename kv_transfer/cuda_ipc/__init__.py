"""`cuda_ipc` KV transfer: P and D on one host (one GPU or two with P2P), P's kernels write into D's pool.

    D: CudaIpcKVReceiver exports its per-layer pools as CUDA IPC handles (descriptor.py) once
       expect(request_id, blocks) ─▶ TransferTarget{backend "cuda_ipc", host, port}      as tcp
    P: begin(target) ─▶ control connection (kv_transfer/control/): hello / auth (HMAC) / ready / pools ─▶ open D's pools
       layer i done ─▶ copy_blocks(P pool[i] ─▶ D pool[i]) on a transfer stream, blocking event recorded
       finish ─▶ event synchronized in a worker thread ─▶ "done" frame
    D: "done" ─▶ every layer recorded ─▶ on_complete

Bytes never cross the socket, only control frames (msgpack, never pickle).
"""

from pdserve.kv_transfer.cuda_ipc.descriptor import LayerHandle, PoolDescriptor, export_pools, open_pools
from pdserve.kv_transfer.cuda_ipc.receiver import CudaIpcKVReceiver
from pdserve.kv_transfer.cuda_ipc.sender import CudaIpcKVSender

__all__ = ["CudaIpcKVReceiver", "CudaIpcKVSender", "LayerHandle", "PoolDescriptor", "export_pools", "open_pools"]
