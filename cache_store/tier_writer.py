"""A background thread that moves copied KV blocks down the tiers (host RAM, Redis) off the step thread.

    step thread / lookup threads            writer thread ("kv-tier-writer")
    ────────────────────────────            ─────────────────────────────────
    gather blocks → staging (+ CUDA event)
    submit(job)  ── bounded by bytes ──▶    event.synchronize(); process(job): host put, Redis SET
                 (full: job dropped,
                  counted, never waits)

`submit` never blocks the caller: when the queued copies exceed `max_pending_bytes` the job is dropped (a
cache write is an optimisation; stalling a forward for it is not). `flush` waits for the queue to drain.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from pdserve.cache_store.tier_stats import TieredCacheStats

logger = logging.getLogger(__name__)

RedisTarget = Literal["none", "admitted", "all"]


@dataclass(frozen=True)
class WriteJob:
    """Blocks copied out of the pool (or fetched) on their way to the host tier and/or Redis.

    redis: "none" (host only; what the host evicts may still go on under write-back), "admitted" (those
    with enough hits), "all" (admission already decided). only_missing: skip blocks Redis already has.
    """

    hashes: tuple[bytes, ...]
    salts: tuple[str | None, ...]
    blocks: torch.Tensor  # [n, layers, 2, block_size, Hkv, D], CPU
    to_host: bool
    redis: RedisTarget
    only_missing: bool = False
    ready: torch.cuda.Event | None = None  # the device → host copy is done once this fires

    @property
    def nbytes(self) -> int:
        return int(self.blocks.numel() * self.blocks.element_size())


class TierWriter:
    def __init__(self, process: Callable[[WriteJob], None], stats: TieredCacheStats, max_pending_bytes: int) -> None:
        self._process = process
        self._stats = stats
        self._max_pending_bytes = max_pending_bytes
        self._jobs: deque[WriteJob] = deque()
        self._pending_bytes = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()

    def submit(self, job: WriteJob) -> bool:
        """Queue `job`; False (counted as dropped) when the queue is full or the writer closed."""
        with self._cond:
            if self._closed or self._pending_bytes + job.nbytes > self._max_pending_bytes:
                self._stats.count(writes_dropped_blocks=len(job.hashes))
                return False
            self._jobs.append(job)
            self._pending_bytes += job.nbytes
            self._cond.notify_all()
            return True

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued job is processed; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                if job.ready is not None:
                    job.ready.synchronize()
                self._process(job)
            except Exception:  # a failed cache write must not end the writer
                logger.exception("KV tier write of %d blocks failed", len(job.hashes))
            finally:
                with self._cond:
                    self._pending_bytes -= job.nbytes
                    self._busy = False
                    self._cond.notify_all()
