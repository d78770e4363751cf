"""`tcp` backend, decode side: an asyncio server that writes incoming KV frames into the layer pools.

A connection's life:

    accept ─▶ send hello{nonce} ─▶ read auth{mac} (checked when a secret is set) ─▶ send ready
           ─▶ loop: header ─▶ checks (below) ─▶ payload ─▶ crc32 ─▶ scatter_blocks into pools[layer]
                    done  ─▶ TransferTable.complete ─▶ on_complete / on_failure
                    error ─▶ on_failure ("sender gave up")
           ─▶ close: any request this connection carried that is still pending fails

Checks before the payload is read, so nothing is allocated for a bad frame: the request id is expected;
the layer exists; block ids are distinct and reserved for that request; dtype is the pool's and on the
whitelist; shape is [2, n, block_size, Hkv, D] of the pool with n = len(block_ids); nbytes equals
prod(shape) * itemsize and is within FrameLimits.max_payload_bytes. Any violation drops the connection
(the stream is no longer trustworthy) and fails the requests it carried: the node frees their blocks.
Other connections are untouched.

Scatter runs on the loop thread: on CPU it is one memcpy of the frame; on CUDA the host→device copy of a
pageable buffer is synchronous. Measured on the H200 host (16 cores), sender and receiver in one process
and one loop over loopback, 32 layers × 128 blocks of Llama-3-8B shape in bf16 (256 MiB): about
0.7 GB/s for CPU and for CUDA pools, of which crc32 (3.4 GiB/s there) takes about 40 %; a 4 MiB stream
buffer limit instead of the default 64 KiB changed nothing. Next steps, by measured cost: a faster
checksum (xxh3: 6.7 GiB/s there), then a BufferedProtocol reading straight into (pinned) payload buffers,
which removes two of the receive path's copies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from pdserve.kernels.block_copy import scatter_blocks
from pdserve.kv_transfer.base import KVReceiver, OnComplete, OnFailure
from pdserve.kv_transfer.wire import (
    Auth,
    BulkKVHeader,
    Done,
    Error,
    FrameLimits,
    Header,
    Hello,
    KVHeader,
    Lost,
    Pools,
    ProtocolError,
    Ready,
    Rendezvous,
    StoredKV,
    check_auth,
    encode_frame,
    read_header,
    read_payload,
    tensor_from_payload,
    write_frame,
)

logger = logging.getLogger(__name__)


class TcpKVReceiver(KVReceiver):
    backend = "tcp"

    def __init__(
        self,
        host: str,
        port: int,
        pools: Sequence[torch.Tensor],
        on_complete: OnComplete,
        on_failure: OnFailure,
        *,
        secret: str | None = None,
        limits: FrameLimits | None = None,
        advertise_host: str | None = None,
    ) -> None:
        """`port` 0 picks a free port (see `.port` after `start`); `advertise_host` is what targets name
        (defaults to `host`; set it when binding 0.0.0.0)."""
        super().__init__(pools, on_complete, on_failure)
        self.host = host
        self.port = port
        self.advertise_host = advertise_host or host
        self.secret = secret
        self.limits = limits or FrameLimits()
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        carried: set[str] = set()
        reason = "connection closed before done"
        try:
            await self._handshake(reader, writer)
            while (header := await read_header(reader, self.limits)) is not None:
                await self._handle(header, reader, carried)
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

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonce = os.urandom(16)
        await write_frame(writer, encode_frame(Hello(nonce)))
        # No idle wait here: a peer that connects must authenticate promptly.
        limits = dataclasses.replace(self.limits, idle_timeout_s=self.limits.read_timeout_s)
        auth = await read_header(reader, limits)
        try:
            if not isinstance(auth, Auth):
                raise ProtocolError(f"expected an auth frame first, got {type(auth).__name__}")
            check_auth(self.secret, nonce, auth)
        except ProtocolError as exc:
            await write_frame(writer, encode_frame(Error("", str(exc))))  # tell a misconfigured sender why
            raise
        await write_frame(writer, encode_frame(Ready()))
        await self._after_ready(writer)

    async def _after_ready(self, writer: asyncio.StreamWriter) -> None:
        """What a backend on this control path sends once a sender is authenticated (cuda_ipc: its pools)."""

    async def _handle(self, header: Header, reader: asyncio.StreamReader, carried: set[str]) -> None:
        if isinstance(header, Hello | Auth | Ready | Pools | Rendezvous | BulkKVHeader | StoredKV | Lost):
            raise ProtocolError(f"unexpected {header.KIND} frame on a {self.backend} connection after the handshake")
        live = header.request_id in self.table
        if not live and not self.table.recently_ended(header.request_id):
            raise ProtocolError(f"{header.KIND} frame for unknown request id {header.request_id!r}")
        if isinstance(header, KVHeader):
            carried.add(header.request_id)
            await self._receive_kv(header, reader)
            return
        carried.discard(header.request_id)
        if not live:  # done/error of a request that already ended: its blocks, if they were held, are free now
            self.table.release(header.request_id)
            return
        if isinstance(header, Done):
            top = list(zip(header.top_token_ids, header.top_logprobs, strict=False))
            self.table.complete(header.request_id, header.first_token_id, header.first_logprob, header.num_tokens, top)
        else:
            self.table.fail(header.request_id, f"sender gave up: {header.reason}")

    async def _receive_kv(self, header: KVHeader, reader: asyncio.StreamReader) -> None:
        """Frames of a request that ended meanwhile (lease expired, cancelled) are read and dropped, so
        one expired request does not cost the other requests sharing its connection."""
        problem = self._check_kv(header)
        if problem is not None:
            raise ProtocolError(f"kv frame for {header.request_id!r} layer {header.layer}: {problem}")
        payload = await read_payload(reader, header, self.limits)
        if header.request_id not in self.table:
            return
        pool = self.pools[header.layer]
        blocks = tensor_from_payload(payload, header).to(pool.device)
        block_ids = torch.tensor(header.block_ids, dtype=torch.int64, device=pool.device)
        scatter_blocks(pool, block_ids, blocks)
        self.table.record_layer(header.request_id, header.layer, header.block_ids)

    def _check_kv(self, header: KVHeader) -> str | None:
        return self._check_blocks(header.request_id, header.layer, header.block_ids, header.dtype, header.shape,
                                  header.nbytes)
