"""The decode side of the control channel: an asyncio server whose connections carry control frames, and the
`ListeningReceiver` that the tcp, cuda_ipc and nccl receivers are.

A connection's life:

    accept ─▶ handshake.accept (hello / auth checked with the secret / ready)
           ─▶ path = receiver.open_path(writer)   the backend's data path for this connection; it may send
                                                   first (cuda_ipc: its pools; nccl: the rendezvous, then the join)
           ─▶ loop: header ─▶ done / error          ─▶ end_transfer: TransferTable.complete / fail
                              one of path.carries   ─▶ path.receive(header, reader)  (tcp: kv; nccl: kv_bulk)
                              anything else         ─▶ ProtocolError (path.refusal says why)
           ─▶ close: path.close(); any request this connection carried that is still pending fails

Connections read through a PayloadReader (kv_transfer/payload_reader.py): a kv frame's payload lands in the
receiver's buffer straight from the socket.

A frame for a request id that was never expected is a protocol violation; one for a request that ended
meanwhile (lease expired, cancelled) is dropped (its payload read first, so the other requests sharing the
connection go on). Any violation drops the connection (the stream is no longer trustworthy) and fails the
requests it carried: the node frees their blocks. Other connections are untouched. With `remote_writes`
(cuda_ipc: the sender wrote the pool itself) a "done" means every layer of every reserved block is there.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, TypedDict, Unpack

import torch

from pdserve.kv_transfer.base import KVReceiver, OnComplete, OnFailure
from pdserve.kv_transfer.control.handshake import accept
from pdserve.kv_transfer.payload_reader import PayloadReader, start_payload_server
from pdserve.kv_transfer.transfer_table import TransferTable
from pdserve.kv_transfer.wire import (
    BulkKVHeader,
    Done,
    Error,
    FrameLimits,
    Header,
    KVHeader,
    ProtocolError,
    read_header,
)

logger = logging.getLogger(__name__)
DataFrame = KVHeader | BulkKVHeader  # the frames a connection's data path may carry


def end_transfer(table: TransferTable, header: Done | Error) -> None:
    """The sender's last word on a live request: complete it (done) or fail it (error)."""
    if isinstance(header, Done):
        top = list(zip(header.top_token_ids, header.top_logprobs, strict=False))
        table.complete(header.request_id, header.first_token_id, header.first_logprob, header.num_tokens, top)
    else:
        table.fail(header.request_id, f"sender gave up: {header.reason}")


def check_frame(receiver: KVReceiver, header: DataFrame, nbytes: int) -> None:
    """ProtocolError unless the blocks a data frame announces may be read into the pool (KVReceiver.check_blocks)."""
    problem = receiver.check_blocks(header.request_id, header.layer, header.block_ids, header.dtype, header.shape,
                                    nbytes)
    if problem is not None:
        raise ProtocolError(f"{header.KIND} frame for {header.request_id!r} layer {header.layer}: {problem}")


class ListenOptions(TypedDict, total=False):
    secret: str | None  # the deployment's (PDSERVE_SECRET): senders must prove they hold it; None: anyone
    limits: FrameLimits | None  # what a frame may claim before anything is allocated (FrameLimits())
    advertise_host: str | None  # what targets name (defaults to `host`; set it when binding 0.0.0.0)


class ConnectionPath(ABC):
    """One accepted connection's data path: the frames it carries besides done and error."""

    carries: ClassVar[tuple[type[DataFrame], ...]] = ()

    def refusal(self, header: Header, backend: str) -> str:
        return f"unexpected {header.KIND} frame on a {backend} connection after the handshake"

    async def receive(self, header: DataFrame, reader: PayloadReader) -> None:
        """A frame of `carries` for a request that is live or recently ended (ProtocolError: drop)."""
        raise ProtocolError(f"a {header.KIND} frame on a connection that carries none")

    def close(self) -> None:
        """The connection ended."""


class ListeningReceiver(KVReceiver):
    """A receiver reached over the control server; each backend says what a connection's data path is."""

    def __init__(self, host: str, port: int, pools: Sequence[torch.Tensor], on_complete: OnComplete,
                 on_failure: OnFailure, **options: Unpack[ListenOptions]) -> None:
        """`port` 0 picks a free port (see `.port` after `start`)."""
        super().__init__(pools, on_complete, on_failure)
        self.host = host
        self.port = port
        self.advertise_host = options.get("advertise_host") or host
        self.secret = options.get("secret")
        self.limits = options.get("limits") or FrameLimits()
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    @abstractmethod
    async def open_path(self, writer: asyncio.StreamWriter) -> ConnectionPath:
        """A sender was authenticated on this connection: its data path (may write to the sender first)."""

    async def start(self) -> None:
        self._server = await start_payload_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("KV receiver listening on %s:%d", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        # Closing the sockets ends each handler at its next read; cancelling the handler tasks instead
        # makes asyncio.streams (3.11) log a spurious CancelledError per connection.
        for writer in self._connections.values():
            writer.close()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        await super().close()

    def _address(self, request_id: str) -> dict[str, Any]:
        return {"host": self.advertise_host, "port": self.port}

    # ---- one connection -------------------------------------------------------------------------

    async def _serve(self, reader: PayloadReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        carried: set[str] = set()
        reason = "connection closed before done"
        path: ConnectionPath | None = None
        try:
            await accept(reader, writer, self.secret, self.limits)
            path = await self.open_path(writer)
            while (header := await read_header(reader, self.limits)) is not None:
                await self._handle(header, reader, path, carried)
        except ProtocolError as exc:
            reason = f"protocol error: {exc}"
            logger.warning("dropping KV connection from %s: %s", writer.get_extra_info("peername"), exc)
        except (ConnectionError, OSError) as exc:
            reason = f"connection lost: {exc}"
        except Exception as exc:  # a bug must cost this connection, not the server
            reason = f"receiver error: {exc!r}"
            logger.exception("KV connection handler failed")
        finally:
            del self._connections[task]
            writer.close()
            for request_id in carried:
                self.table.fail(request_id, reason)
            if path is not None:
                path.close()

    async def _handle(self, header: Header, reader: PayloadReader, path: ConnectionPath,
                      carried: set[str]) -> None:
        if isinstance(header, Done | Error):
            self._end(header, carried)
            return
        if not isinstance(header, KVHeader | BulkKVHeader) or not isinstance(header, path.carries):
            raise ProtocolError(path.refusal(header, self.backend))
        self._live(header)
        carried.add(header.request_id)
        await path.receive(header, reader)

    def _end(self, header: Done | Error, carried: set[str]) -> None:
        live = self._live(header)
        carried.discard(header.request_id)
        if not live:  # done/error of a request that already ended: its blocks, if they were held, are free now
            self.table.release(header.request_id)
            return
        if isinstance(header, Done) and self.remote_writes:
            self.table.record_all(header.request_id)
        end_transfer(self.table, header)

    def _live(self, header: DataFrame | Done | Error) -> bool:
        """Whether the frame's request is pending (False: it ended recently); ProtocolError if never expected."""
        live = header.request_id in self.table
        if not live and not self.table.recently_ended(header.request_id):
            raise ProtocolError(f"{header.KIND} frame for unknown request id {header.request_id!r}")
        return live
