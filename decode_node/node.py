"""The decode role of a worker: turns RESERVE messages into reservations, owns the engine and the KV receiver,
and reports status and metrics. The data-plane messages are handled in service.py; scheduling in scheduler.py.

    RESERVE ─▶ checks ─▶ scheduler.reserve: the prompt's cached prefix (this worker's prefix cache) + new blocks
        ├─ uncached suffix < RESERVE's max_local_prefill ─▶ RESERVED {transfer: {}, cached, local_prefill}:
        │     D prefills the suffix at its next step (no transfer, no P)
        └─ else ─▶ the receiver expects the new blocks ─▶ RESERVED {target: the new blocks only, cached}
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.cache_store.hashing import block_hashes
from pdserve.cache_store.tier_reader import FetchedPrefix
from pdserve.decode_node.engine import DecodeEngine
from pdserve.decode_node.request import DecodeRequest, RequestState
from pdserve.decode_node.scheduler import Scheduler
from pdserve.engine.detokenizer import Decoder, IncrementalDetokenizer, StopChecker
from pdserve.engine.grammar import GrammarBackend, GrammarError, Matcher
from pdserve.engine.output import NoTextDecoder
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.base import KVReceiver
from pdserve.protocol.messages import Refused, Reserve, Reserved

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeNodeConfig:
    max_model_len: int
    vocab_size: int
    block_size: int
    kv_lease_timeout_s: float
    model_fingerprint: str  # the KV compatibility key (engine/kv_cache_spec.py): model, KV dtype, fp8 scales
    # colocated: a reservation also stages the host RAM / Redis blocks after the device's prefix (the prefill
    # side shares the pool and computes into it); a disaggregated decode worker looks up its device tier only
    fetch_lower_tiers: bool = False


class DecodeNode:
    def __init__(self, engine: DecodeEngine, receiver: KVReceiver, decoder: Decoder | None,
                 config: DecodeNodeConfig, grammars: GrammarBackend | None = None) -> None:
        self.engine = engine
        self.grammars = grammars  # structured outputs: each request's matcher is rebuilt here from its spec
        self.receiver = receiver
        engine.cancel_transfer = receiver.cancel
        engine.release_transfer = receiver.release_after_sender
        self.decoder: Decoder = decoder if decoder is not None else NoTextDecoder()
        self.config = config
        self.started_at = time.time()
        self._fetching: dict[str, bool] = {}  # request id -> aborted, while a colocated reservation looks up

    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler

    @property
    def state_lock(self) -> threading.RLock:
        return self.engine.state_lock

    async def start(self) -> None:
        await self.receiver.start()
        self.engine.start(asyncio.get_running_loop())

    async def stop(self) -> None:
        self.engine.stop()
        await self.receiver.close()

    # ---- reserve --------------------------------------------------------------------------------------

    async def reserve(self, message: Reserve) -> Reserved | Refused:
        """Validate, reserve blocks and register the expected transfer (event loop thread)."""
        request_id = message.request_id
        try:
            request = self._build(message)
            loading = await self._attach_grammar(request)
        except ValueError as exc:
            return Refused(request_id, 400, str(exc))
        aborted, fetched = await self._fetch(request)
        if aborted:
            return Refused(request_id, 499, f"request {request_id!r} aborted while its prefix was looked up")
        if request.grammar_error is not None:  # built (and failed) while the prefix was looked up
            return Refused(request_id, 400, request.grammar_error)
        # a matcher still loading cannot sample a local prefill's first token: P computes it
        max_local_prefill = 0 if loading else message.max_local_prefill
        with self.state_lock:
            refusal = self.scheduler.reserve(request, fetched, max_local_prefill)
            if refusal is not None:
                return Refused(request_id, refusal.status, refusal.message, refusal.retry_after)
            if request.state == RequestState.LOCAL_PREFILL:
                self.engine.wake()
                return Reserved(request_id, {}, request.cached_tokens, local_prefill=True)
            expected = self.scheduler.expected_block_ids(request)
        deadline = time.monotonic() + self.config.kv_lease_timeout_s
        carried = len(request.prompt_token_ids) - request.cached_tokens
        try:
            target = self.receiver.expect(request_id, expected, deadline, num_tokens=carried,
                                          first_block=request.cached_tokens // self.config.block_size)
        except ValueError as exc:  # a bookkeeping bug: give the blocks back rather than leak them
            self.engine.kv_failed(request_id, f"cannot expect the transfer: {exc}")
            return Refused(request_id, 500, f"cannot expect the transfer of {request_id!r}: {exc}")
        target = dataclasses.replace(target, kv_fingerprint=self.config.model_fingerprint)  # P checks it is its own
        return Reserved(request_id, target.to_dict(), request.cached_tokens)

    def _build(self, message: Reserve) -> DecodeRequest:
        prompt, cache_salt = message.prompt_token_ids, message.cache_salt
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {self.config.vocab_size})")
        if len(prompt) + 1 > self.config.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room for output: the model's limit is "
                             f"{self.config.max_model_len} tokens")
        params = SamplingParams.from_dict(message.sampling)
        if message.max_local_prefill < 0:
            raise ValueError(f"max_local_prefill must be >= 0, got {message.max_local_prefill}")
        hashes = []
        if self.scheduler.prefix_cache is not None:
            hashes = block_hashes(prompt, self.config.block_size, self.config.model_fingerprint, cache_salt)
        return DecodeRequest(
            message.request_id, list(prompt), params, IncrementalDetokenizer(self.decoder, prompt),
            StopChecker(params.stop), cache_salt=cache_salt, block_hashes=hashes, arrival_time=message.arrival_time,
        )

    async def _attach_grammar(self, request: DecodeRequest) -> bool:
        """The matcher P's first token will be accepted into (at kv_complete), compiled off the event loop.

        Until the worker's grammar compiler has loaded (its first constrained request: xgrammar and the vocabulary,
        ~1.4 s of CPU, more on a busy host than the router's --reserve-timeout-s allows) the reservation does
        not wait: the matcher is built on a thread and attached when done, and the engine holds the request's
        first token until then (DecodeEngine._after_grammar). Returns whether it is still being built."""
        spec = request.sampling.structured
        if spec is None:
            return False
        grammars = self.grammars
        if grammars is None:
            raise GrammarError("structured outputs need the model's tokenizer; this worker has none")
        if grammars.ready:
            request.grammar = await asyncio.to_thread(grammars.matcher, spec)
            return False
        loading: concurrent.futures.Future[Matcher] = concurrent.futures.Future()
        request.grammar_loading = loading
        loop = asyncio.get_running_loop()
        loading.add_done_callback(lambda _: loop.call_soon_threadsafe(self._grammar_built, request))

        def build() -> None:
            try:
                loading.set_result(grammars.matcher(spec))
            except Exception as exc:  # noqa: BLE001 (handed to _grammar_built, on the event loop)
                loading.set_exception(exc)

        threading.Thread(target=build, name=f"grammar-{request.request_id}", daemon=True).start()
        return True

    def _grammar_built(self, request: DecodeRequest) -> None:
        """Event loop: attach the matcher built for a reservation that did not wait (or fail the request)."""
        loading = request.grammar_loading
        assert loading is not None
        with self.state_lock:
            request.grammar_loading = None
            error = loading.exception()
            if error is None:
                request.grammar = loading.result()
                return
            request.grammar_error = str(error) if isinstance(error, GrammarError) else f"no matcher: {error}"
            live = self.scheduler.queues.requests.get(request.request_id) is request
        if live:
            self.engine.abort(request.request_id, request.grammar_error)

    async def _fetch(self, request: DecodeRequest) -> tuple[bool, FetchedPrefix | None]:
        """Colocated with host / Redis tiers: stage the blocks after the device's cached prefix for the
        reservation to load (off the step thread). Returns (aborted meanwhile, the staged blocks)."""
        tiered, scheduler = self.scheduler.tiered, self.scheduler
        lookup = scheduler.prefix_lookup_hashes(request)
        if not self.config.fetch_lower_tiers or tiered is None or not tiered.has_lower_tiers or not lookup:
            return False, None
        self._fetching[request.request_id] = False
        fetched = None
        try:
            fetched = await tiered.fetch_async(lookup, request.cache_salt)
        except Exception:  # a cache bug costs a recompute, never the request
            logger.exception("host/Redis lookup of %s failed; its whole prompt is computed", request.request_id)
        return self._fetching.pop(request.request_id), fetched

    def abort(self, request_id: str, reason: str, sender_may_write: bool = True) -> bool:
        """Event loop thread: free what the request holds; one still being looked up is refused after."""
        if request_id in self._fetching:
            self._fetching[request_id] = True
            return True
        return self.engine.abort(request_id, reason, sender_may_write)

    def sender_lost(self, request_id: str, reason: str) -> None:
        """Event loop thread: the router saw the request's prefill worker go before its first token."""
        with self.state_lock:
            request = self.scheduler.queues.requests.get(request_id)
            waiting = request is not None and request.state == RequestState.WAITING_FOR_KV
        if waiting:
            self.receiver.sender_lost(request_id, reason)

    def waiting_reservation(self, request_id: str) -> tuple[list[int], int] | None:
        """(block ids, cached tokens) of a reservation still waiting for its KV; call under `state_lock`.
        The colocated prefill side computes straight into these blocks."""
        request = self.scheduler.queues.requests.get(request_id)
        if request is None or request.state != RequestState.WAITING_FOR_KV:
            return None
        return list(request.block_ids), request.cached_tokens

    # ---- status and metrics --------------------------------------------------------------------------

    def status(self) -> dict[str, int]:
        with self.state_lock:
            queues, pool = self.scheduler.queues, self.scheduler.pool
            return {"queue_len": queues.num_waiting_for_kv, "num_running": len(queues.running),
                    "num_waiting": queues.num_waiting, "free_blocks": pool.num_free,
                    "total_blocks": pool.num_total, "num_preempted": len(queues.preempted)}

    def collect(self) -> Iterator[Metric]:
        """Prometheus metrics (a custom collector: read at scrape time, no global registry)."""
        status = self.status()
        stats = self.engine.stats
        for name in ("num_running", "num_waiting", "free_blocks", "total_blocks", "num_preempted"):
            yield GaugeMetricFamily(f"pdserve_decode_{name}", f"decode {name.replace('_', ' ')}", status[name])
        yield GaugeMetricFamily("pdserve_decode_kv_transfers_pending", "reservations waiting for their KV",
                                self.receiver.num_pending)
        yield CounterMetricFamily("pdserve_decode_steps", "decode steps run", stats.num_steps)
        yield CounterMetricFamily("pdserve_decode_batched_rows", "decode rows over all steps (/ steps: the mean "
                                  "decode batch; above the tokens when rows ended by EOS ran one step ahead)",
                                  stats.num_batched_rows)
        yield CounterMetricFamily("pdserve_decode_generated_tokens", "tokens sampled by decode steps",
                                  stats.num_generated_tokens)
        yield CounterMetricFamily("pdserve_decode_recomputed_tokens", "tokens prefilled again after preemption",
                                  stats.num_recomputed_tokens)
        yield CounterMetricFamily("pdserve_decode_reused_prompt_tokens", "prompt tokens reservations found in this "
                                  "worker's prefix cache (no prefill worker sent them)", self.scheduler.num_reused_tokens)
        yield CounterMetricFamily("pdserve_decode_local_prefills", "reservations this worker prefilled itself "
                                  "(conditional disaggregation: no prefill worker, no transfer)",
                                  self.scheduler.num_local_prefills)
        yield CounterMetricFamily("pdserve_decode_local_prefill_tokens", "prompt tokens those local prefills "
                                  "computed", stats.num_local_prefill_tokens)
        yield CounterMetricFamily("pdserve_decode_preemptions", "requests preempted", self.scheduler.num_preemptions)
        yield CounterMetricFamily("pdserve_decode_kv_load_failures", "reservations whose KV did not arrive (lease, "
                                  "P gone or gave up)", self.scheduler.num_kv_load_failures)
        yield CounterMetricFamily("pdserve_decode_kv_recomputes", "of those, requests prefilled on this worker "
                                  "(--kv-load-failure-policy recompute)", self.scheduler.num_kv_recomputes)
        yield CounterMetricFamily("pdserve_decode_step_seconds", "time spent in decode steps", stats.step_seconds)
        phases = CounterMetricFamily("pdserve_decode_step_phase_seconds", "decode step time by phase (schedule, "
                                     "forward, sample, update, publish)", labels=["phase"])
        for phase, seconds in stats.phase_seconds.items():
            phases.add_metric([phase], seconds)
        yield phases
        device = CounterMetricFamily("pdserve_decode_step_device_seconds", "on CUDA, the device's time per part of "
                                     "the steps (CUDA events): forward (inputs staged, graph), sample", labels=["part"])
        for part, seconds in stats.device_seconds.items():
            device.add_metric([part], seconds)
        yield device
        yield CounterMetricFamily("pdserve_decode_forward_rows", "rows the decode forwards ran, padding to the "
                                  "CUDA-graph bucket included", stats.num_forward_rows)
        yield CounterMetricFamily("pdserve_decode_forward_cpu_seconds", "CPU time of the decode step thread inside "
                                  "forwards (below the forward phase's wall time: the thread waited)",
                                  stats.forward_cpu_seconds)
        finished = CounterMetricFamily("pdserve_decode_requests_finished", "finished requests",
                                       labels=["finish_reason"])
        for reason, count in sorted(stats.finished.items()):
            finished.add_metric([reason], count)
        yield finished
