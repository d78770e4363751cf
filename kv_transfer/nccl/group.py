"""One P–D pair's two-rank torch.distributed group, the store it meets through, and waits with deadlines.

    D: RendezvousStore (one TCPStore master per receiver, port 0: any free port)
       per accepted connection: key = 16 random bytes, hex ─▶ "rendezvous" frame ─▶ PairGroup.join(rank 0)
    P: "rendezvous" frame ─▶ TCPStore client to D's store ─▶ PairGroup.join(rank 1)
       both: PrefixStore(key) so that many pairs share D's store; a one-element warm-up send/recv inside
       join, so NCCL's lazy communicator set-up (seconds, blocking the caller) never runs on an event loop

The group is built from the backend class itself (ProcessGroupGloo / ProcessGroupNCCL with a store, a rank and
a size), not `init_process_group`: that one is global, one per process, and a decode worker pairs with many
prefill workers. Gloo is given its device explicitly (the interface the control connection uses), not
resolved from the hostname, which in containers often names no reachable address.

Deadlines. Gloo's `Work.wait(timeout)` raises once the deadline passes; a peer that dies mid-transfer makes
it raise at once ("Connection closed by peer"); neither `abort()` nor `shutdown()` wakes a pending gloo recv
(tried on torch 2.13), so waits run in daemon threads (`in_thread`) and a closing receiver stops awaiting
them. NCCL's `wait()` would only order the calling thread's stream after the op (a stream stuck on a dead
peer stalls everything queued behind it), so an NCCL op is polled with `is_completed()` until its deadline
and the group is aborted when it passes; ProcessGroupNCCL's own watchdog is set to twice the deadline so
that this abort comes first. The NCCL path is written, not yet run (it needs two GPUs).

Trust. Gloo terminates the process when a received message is larger than the posted buffer (an enforce
in gloo's tcp pair, measured: `op.preamble.length <= op.nbytes`), so both sides post exactly the size the
"kv_bulk" header names after the receiver checked it; only peers that passed the HMAC handshake learn the
key of a group.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from pdserve.kv_transfer.base import KVTransferError

GROUP_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # pool device type -> torch.distributed backend
RECEIVER_RANK, SENDER_RANK = 0, 1
_TAG = 0  # one tag: messages between a pair match in posting order, the order of the control frames
_POLL_S = 0.0002  # NCCL completion polling: 0.2 ms against a ~2 ms 16 MiB layer send
T = TypeVar("T")


def group_backend(device: torch.device) -> str:
    """"nccl" for a CUDA pool, "gloo" for a CPU one (so the backend runs, and is tested, without a GPU)."""
    if device.type not in GROUP_BACKENDS:
        raise KVTransferError(f"the nccl KV transfer backend has no process group for {device.type} pools")
    if not dist.is_available() or not (dist.is_nccl_available() if device.type == "cuda" else dist.is_gloo_available()):
        raise KVTransferError(f"this torch {torch.__version__} build lacks the {GROUP_BACKENDS[device.type]} "
                              f"process group the nccl KV transfer backend needs for a {device.type} pool")
    return GROUP_BACKENDS[device.type]


def local_address(peer_host: str, peer_port: int) -> str:
    """The address of this host's interface that reaches the peer (a UDP connect sends nothing)."""
    try:
        if ipaddress.ip_address(peer_host).is_loopback:
            return peer_host
    except ValueError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer_host, peer_port))
        address: str = probe.getsockname()[0]
        return address


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a daemon thread: a wait stuck on a dead peer neither holds an executor slot nor
    delays the interpreter's exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = fn(*args), None
        except Exception as exc:  # noqa: BLE001 - delivered to the awaiting task, re-raised there
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while this thread waited: nobody is listening
            pass

    thread = threading.Thread(target=run, name="kv-group-wait", daemon=True)
    thread.start()
    try:
        return await future
    finally:
        if not future.cancelled():
            # it settled the future and has only to return: joined so that it never drops the last reference
            # to a group or a Work. Torch destroys those with the GIL released; a daemon thread taking the GIL
            # back while the interpreter exits unwinds through a noexcept frame: "terminate called without an
            # active exception", SIGABRT (tests/kv_transfer/test_nccl.py: 2 sender exits in 6 on a loaded 2-core box)
            thread.join()


class RendezvousStore:
    """D's TCPStore master; every pair's keys live under the pair's own prefix."""

    def __init__(self, host: str, timeout_s: float) -> None:
        self.store = dist.TCPStore(host, 0, None, True, datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.port = self.store.port

    def prefixed(self, key: str) -> dist.PrefixStore:
        return dist.PrefixStore(key, self.store)


def client_store(host: str, port: int, key: str, timeout_s: float) -> dist.PrefixStore:
    """P's side of D's store (blocks up to `timeout_s` connecting)."""
    store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(key, store)


class PairGroup:
    """A two-rank group: rank 0 is the decode worker (receives), rank 1 the prefill worker (sends)."""

    def __init__(self, backend: str, group: Any, device: torch.device, timeout_s: float) -> None:
        self.backend = backend
        self.device = device
        self.timeout_s = timeout_s
        self._group = group
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @classmethod
    def join(cls, backend: str, store: dist.Store, rank: int, device: torch.device, local_host: str,
             timeout_s: float) -> PairGroup:
        """Blocking: returns once the peer joined and a warm-up message went through; call in a thread."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
            group: Any = dist.ProcessGroupGloo(store, rank, 2, options)
        elif backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            torch.cuda.set_device(device)
            nccl_options = ProcessGroupNCCL.Options()
            nccl_options._timeout = 2 * timeout  # the watchdog's; our own deadline aborts first (see above)
            group = ProcessGroupNCCL(store, rank, 2, nccl_options)
        else:
            raise KVTransferError(f"unknown process group backend {backend!r}; the nccl KV backend uses nccl or gloo")
        pair = cls(backend, group, device, timeout_s)
        probe = torch.zeros(1, device=device)
        work = pair.send(probe) if rank == SENDER_RANK else pair.recv(probe)
        pair.wait(work, "warm-up message")
        return pair

    def side_stream(self) -> contextlib.AbstractContextManager[object]:
        """On CUDA, the group's own stream as the current one (its ops, and buffers allocated meanwhile, are
        ordered there and not behind the decode steps on the default stream); on CPU nothing."""
        if self._stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self._stream))
        return stack

    def synchronize(self) -> None:
        """Blocking: everything queued on the side stream has run."""
        if self._stream is not None:
            self._stream.synchronize()

    def send(self, tensor: torch.Tensor, after: torch.cuda.Event | None = None) -> Any:
        """Post a send to the receiver; on CUDA it starts once `after` (the gather's event) completed."""
        return self._post(self._group.send, tensor, RECEIVER_RANK, after)

    def recv(self, tensor: torch.Tensor) -> Any:
        return self._post(self._group.recv, tensor, SENDER_RANK, None)

    def wait(self, work: Any, what: str, timeout_s: float | None = None) -> None:
        """Blocking, for a thread: the op completed, or KVTransferError after the deadline / a peer's failure."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            if self.backend == "gloo":
                work.wait(datetime.timedelta(seconds=timeout_s))
                return
            deadline = time.monotonic() + timeout_s
            while not work.is_completed():
                if time.monotonic() > deadline:
                    self.close()
                    raise KVTransferError(f"{self.backend} {what} did not complete within {timeout_s:.1f} s")
                time.sleep(_POLL_S)
            work.wait()  # raises if the op failed
        except RuntimeError as exc:
            raise KVTransferError(f"{self.backend} {what} failed: {str(exc).splitlines()[0][:300]}") from None

    def close(self) -> None:
        """Give the group up; the peer's pending ops then fail (or time out)."""
        group, self._group = self._group, None
        if group is not None and self.backend == "nccl":
            group.abort()  # frees NCCL kernels stuck on a dead peer; gloo's closes with the object

    def _post(self, op: Callable[..., Any], tensor: torch.Tensor, peer: int, after: torch.cuda.Event | None) -> Any:
        if self._group is None:
            raise KVTransferError(f"the {self.backend} group is closed")
        try:
            if self._stream is None:
                return op([tensor], peer, _TAG)
            # ProcessGroupNCCL orders its op after the CALLER's current stream: a side stream that waits only
            # for the gather keeps a send from waiting for the next layer's compute on the default stream
            with self.side_stream():
                if after is not None:
                    self._stream.wait_event(after)
                return op([tensor], peer, _TAG)
        except RuntimeError as exc:
            raise KVTransferError(f"{self.backend} post failed: {str(exc).splitlines()[0][:300]}") from None
