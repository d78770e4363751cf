"""The prefill role of a worker: checks PREFILL messages and their transfer targets against this worker's KV
layout, builds requests (prefix hashes, or D's blocks when colocated), looks the prompt up in the host / Redis
tiers while D's target is on its way (on the event loop, off the step thread), owns the engine; answers with the
first token and the text it completes; status and metrics. The messages are handled in service.py."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.cache_store.block_pool import blocks_needed
from pdserve.cache_store.hashing import block_hashes, prefix_lookup
from pdserve.engine.detokenizer import Decoder
from pdserve.engine.grammar import GrammarBackend, GrammarError
from pdserve.engine.output import NoTextDecoder, OutputProcessor, SequenceText, logprobs_to_wire
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.base import KVTransferError
from pdserve.kv_transfer.target import TransferTarget
from pdserve.prefill_node.batcher import Batcher
from pdserve.prefill_node.engine import PrefillEngine, PrefillError, PrefillResult
from pdserve.prefill_node.request import PrefillRequest
from pdserve.protocol.messages import Prefill, Prefilled, PrefillFailed

# request_id -> (D's reserved block ids, tokens D found cached) of a reservation waiting for KV; colocated only
LocalReservations = Callable[[str], tuple[list[int], int] | None]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillNodeConfig:
    max_model_len: int
    vocab_size: int
    block_size: int
    num_layers: int
    kv_dtype: str  # wire name, e.g. "float32", "float8_e4m3fn"
    model_fingerprint: str  # the KV compatibility key (engine/kv_cache_spec.py): model, KV dtype, fp8 scales
    transfer_backend: str
    max_queued_requests: int = 1024  # queued (not yet prefilling) or being looked up; more get 503


class PrefillNode:
    def __init__(self, engine: PrefillEngine, config: PrefillNodeConfig, output: OutputProcessor,
                 decoder: Decoder | None = None, local_reservations: LocalReservations | None = None,
                 grammars: GrammarBackend | None = None) -> None:
        self.engine = engine
        self.grammars = grammars  # structured outputs (None: no tokenizer, such requests get 400)
        self.config = config
        self.output = output  # the first token's text and finish state, exactly as D computes them
        self.decoder: Decoder = decoder if decoder is not None else NoTextDecoder()
        self.local_reservations = local_reservations
        self._fetching: dict[str, bool] = {}  # request id -> aborted, while it waits for its target or lookup

    @property
    def batcher(self) -> Batcher:
        return self.engine.batcher

    @property
    def state_lock(self) -> threading.RLock:
        return self.engine.state_lock

    async def start(self) -> None:
        self.engine.start(asyncio.get_running_loop())

    async def stop(self) -> None:
        self.engine.stop()
        await self.engine.sender.close()

    async def prefill(self, message: Prefill,
                      target: Awaitable[dict[str, Any] | None] | None = None) -> Prefilled | PrefillFailed:
        """Check, look the prefix up while D's target arrives (`target`, when the message has none), queue,
        and answer with the first token once its KV was handed off."""
        rid = message.request_id
        try:
            request = self._build(message)
            await self._attach_grammar(request)
        except ValueError as exc:
            return PrefillFailed(rid, 400, str(exc))
        waiting = self.num_queued()
        if waiting >= self.config.max_queued_requests:
            return PrefillFailed(rid, 503, f"queue full: {waiting} requests wait for prefill on this worker "
                                 f"already (--max-queued-requests {self.config.max_queued_requests})", retry_after=1)
        transfer, aborted = await self._prepare(request, message.transfer, target)
        if aborted or transfer is None:
            if transfer is not None:  # D holds the reservation until the sender's part ends: end it
                await self._hand_back(request, transfer, "aborted before it was queued")
            return PrefillFailed(rid, 499, f"request {rid!r} aborted before it was queued")
        try:
            self._attach_target(request, transfer)
            future = self.engine.submit(request)
        except ValueError as exc:
            return self._refuse(request, 400, str(exc))
        except PrefillError as exc:
            return self._refuse(request, exc.status, str(exc))
        except KVTransferError as exc:
            return self._refuse(request, 409, f"cannot send KV for {rid!r}: {exc}")
        try:
            return self._answer(request, await future)
        except PrefillError as exc:
            return PrefillFailed(rid, exc.status, str(exc))

    async def _attach_grammar(self, request: PrefillRequest) -> None:
        """A constrained request's matcher; compiling (cached per worker) runs off the event loop."""
        spec = request.sampling.structured
        if spec is None:
            return
        if self.grammars is None:
            raise GrammarError("structured outputs need the model's tokenizer; this worker has none")
        request.grammar = await asyncio.to_thread(self.grammars.matcher, spec)

    async def _prepare(self, request: PrefillRequest, transfer: dict[str, Any] | None,
                       target: Awaitable[dict[str, Any] | None] | None) -> tuple[dict[str, Any] | None, bool]:
        """Await the host / Redis lookup and, when not given, D's target: (the target, aborted meanwhile)."""
        rid = request.request_id
        self._fetching[rid] = False
        try:
            if transfer is None and target is not None:
                transfer, _ = await asyncio.gather(target, self._fetch(request))
            else:
                await self._fetch(request)
        finally:
            aborted = self._fetching.pop(rid)
        return transfer, aborted

    async def _hand_back(self, request: PrefillRequest, transfer: dict[str, Any], reason: str) -> None:
        """Tell D we will not write its blocks (an "error" on the transfer), so it frees them now rather than
        after its lease: a cuda_ipc receiver holds an aborted request's blocks until its sender says so."""
        try:
            target = TransferTarget.from_dict(transfer)
            self._check_target(target, request.request_id, request.num_prompt_tokens)
            self.engine.sender.begin(target)
        except (ValueError, KVTransferError):
            return  # a target we could not have written to
        await self.engine.sender.abort(request.request_id, reason)

    def _refuse(self, request: PrefillRequest, status: int, message: str) -> PrefillFailed:
        if request.blocks_preassigned:  # colocated: the reference taken on D's blocks
            with self.state_lock:
                self.batcher.pool.free(request.block_ids)
        return PrefillFailed(request.request_id, status, message)

    def _answer(self, request: PrefillRequest, result: PrefillResult) -> Prefilled:
        """The first token as D's first delta will carry it: same output processing, same text."""
        seq = SequenceText.start(self.decoder, request.prompt_token_ids, request.sampling, request.grammar)
        token = self.output.append_token(seq, result.first_token_id)
        logprobs = None
        if request.sampling.logprobs is not None and result.logprobs is not None:
            logprobs = [logprobs_to_wire(result.logprobs)]
        return Prefilled(request.request_id, result.first_token_id, token.text, token.finish_reason, logprobs,
                         result.num_cached_tokens, result.num_computed_tokens, result.prefill_s,
                         request.prompt_logprobs)

    def num_queued(self) -> int:
        """Requests held but not yet prefilling: queued, or being looked up in host RAM / Redis."""
        with self.state_lock:
            return len(self.batcher.queue) + len(self._fetching)

    def abort(self, request_id: str, reason: str) -> bool:
        if request_id in self._fetching:  # not queued yet: `prefill` answers 499 once its lookup returns
            self._fetching[request_id] = True
            return True
        return self.engine.abort(request_id, reason)

    async def _fetch(self, request: PrefillRequest) -> None:
        """Stage the prompt's blocks found in host RAM / Redis (the batcher loads them at admission).
        Colocated requests took theirs with D's reservation."""
        tiered = self.batcher.tiered
        lookup = prefix_lookup(request.block_hashes, request.num_prompt_tokens, self.config.block_size)
        if (tiered is None or not tiered.has_lower_tiers or not lookup or self.engine.sender.shares_pool
                or request.wants_prompt_logprobs):
            return
        try:
            request.fetched = await tiered.fetch_async(lookup, request.cache_salt)
        except Exception:  # a cache bug costs a recompute, never the request
            logger.exception("host/Redis lookup of %s failed; computing the whole prompt", request.request_id)

    def _build(self, message: Prefill) -> PrefillRequest:
        prompt = message.prompt_token_ids
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {self.config.vocab_size})")
        if len(prompt) >= self.config.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens reaches the model's limit of "
                             f"{self.config.max_model_len} tokens")
        params = SamplingParams.from_dict(message.sampling)
        hashes = block_hashes(prompt, self.config.block_size, self.config.model_fingerprint, message.cache_salt)
        return PrefillRequest(message.request_id, list(prompt), params, None, hashes, message.cache_salt)

    def _attach_target(self, request: PrefillRequest, transfer: dict[str, Any]) -> None:
        target = TransferTarget.from_dict(transfer)
        self._check_target(target, request.request_id, request.num_prompt_tokens)
        request.target = target
        if self.engine.sender.shares_pool:
            self._take_local_blocks(request)

    def _check_target(self, target: TransferTarget, request_id: str, num_tokens: int) -> None:
        cfg = self.config
        if target.request_id != request_id:
            raise ValueError(f"transfer target is for {target.request_id!r}, not {request_id!r}")
        if target.backend != cfg.transfer_backend:
            raise ValueError(f"transfer backend {target.backend!r}: this worker sends with {cfg.transfer_backend!r}")
        if (target.num_layers, target.block_size, target.dtype) != (cfg.num_layers, cfg.block_size, cfg.kv_dtype):
            raise ValueError(f"decode worker's KV layout ({target.num_layers} layers, block_size {target.block_size}, "
                             f"{target.dtype}) differs from ours ({cfg.num_layers}, {cfg.block_size}, {cfg.kv_dtype})")
        if target.kv_fingerprint != cfg.model_fingerprint:
            raise ValueError(f"decode worker's KV compatibility key {target.kv_fingerprint!r} differs from ours "
                             f"{cfg.model_fingerprint!r} ({cfg.kv_dtype}): its model, --dtype, --kv-cache-dtype or fp8 "
                             f"KV scales are not ours (--calculate-kv-scales on one side only, or on devices "
                             f"whose calibration pass rounds differently)")
        needed = blocks_needed(num_tokens, cfg.block_size)
        if not self.engine.sender.shares_pool and target.first_block + len(target.block_ids) != needed:
            raise ValueError(f"transfer target has {len(target.block_ids)} blocks after the {target.first_block} D "
                             f"holds; a prompt of {num_tokens} tokens fills {needed}")

    def _take_local_blocks(self, request: PrefillRequest) -> None:
        """Colocated: compute straight into D's reserved blocks, holding our own reference on them."""
        if self.local_reservations is None:
            raise ValueError("a local transfer target needs a colocated (--role both) worker")
        with self.state_lock:
            found = self.local_reservations(request.request_id)
            if found is None:
                raise PrefillError(f"no reservation {request.request_id!r} waiting for KV on this worker", 409)
            block_ids, cached_tokens = found
            block_ids = block_ids[: blocks_needed(request.num_prompt_tokens, self.config.block_size)]
            self.batcher.pool.incref(block_ids)
        request.block_ids = block_ids
        request.blocks_preassigned = True
        request.num_cached_tokens = cached_tokens

    # ---- status and metrics --------------------------------------------------------------------------

    def status(self) -> dict[str, int]:
        with self.state_lock:
            batcher = self.batcher
            return {"queue_len": len(batcher.queue) + len(batcher.prefilling),
                    "num_running": len(batcher.prefilling), "num_waiting": len(batcher.queue),
                    "free_blocks": batcher.pool.num_free, "total_blocks": batcher.pool.num_total}

    def collect(self) -> Iterator[Metric]:
        status = self.status()
        stats = self.engine.stats
        for name in ("queue_len", "num_running", "num_waiting", "free_blocks", "total_blocks"):
            yield GaugeMetricFamily(f"pdserve_prefill_{name}", f"prefill {name.replace('_', ' ')}", status[name])
        cache = self.batcher.cache.stats
        yield GaugeMetricFamily("pdserve_prefill_prefix_hit_rate", "prefix cache hit rate (blocks)", cache.hit_rate)
        for name, value, text in [
            ("forwards", stats.num_forwards, "packed prefill forwards"),
            ("computed_tokens", stats.num_computed_tokens, "prompt tokens computed"),
            ("cached_tokens", stats.num_cached_tokens, "prompt tokens found in the prefix cache"),
            ("requests_completed", stats.num_completed, "prefills whose KV reached the decode worker"),
            ("requests_failed", stats.num_failed, "prefills that failed"),
            ("forward_seconds", stats.forward_seconds, "time spent in prefill forwards"),
            ("transfer_bytes", stats.transfer_bytes, "KV bytes pushed to decode workers"),
            ("transfer_seconds", stats.transfer_seconds, "per request, first KV layer sent to done written"),
        ]:
            yield CounterMetricFamily(f"pdserve_prefill_{name}", text, value)
