"""The worker: loads the engine once and serves the prefill role, the decode role, or both.

    load_model ─▶ ModelRunner (weights + KV pool tensors) ─▶ BlockPool + PrefixCache
        prefill role: Batcher ─ PrefillEngine ─ KV sender      } both built through the kv_transfer registry
        decode role:  Scheduler ─ DecodeEngine ─ KV receiver   } (worker/transfer.py): tcp, local, ...
    KV cache tiers: TieredKVCache over the pool (host RAM, Redis; worker/cache.py), shared by both roles
    the data plane (--data-port): the routers' connections, each message to its role's service
        (decode_node/service.py, prefill_node/service.py, worker/data_plane.py)
    one FastAPI app: /internal/status, /internal/cache, control, /health, /metrics (worker/app.py,
        with `run_worker`, the process's entry point)
    with --router URL(s): register with every router (with the data port), then heartbeat each
        (worker/router_links.py)

A colocated worker (`--role both`) has ONE block pool, one prefix cache, one runner: the prefill side computes
straight into the blocks the decode side reserved (backend `local`, nothing copied). Both step threads share
`state_lock` (pool + schedulers) and `model_lock` (forwards). A decode worker's reservations take their cached
prefix from that same prefix cache too (finished sequences are named there), so P sends only the rest.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.cache_store.block_pool import BlockPool
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.decode_node.engine import DecodeEngine
from pdserve.decode_node.node import DecodeNode, DecodeNodeConfig
from pdserve.decode_node.scheduler import Scheduler
from pdserve.decode_node.service import DecodeService
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.grammar import GrammarBackend
from pdserve.engine.kv_cache import gpu_kv_budget
from pdserve.engine.kv_cache_spec import KVCacheSpec
from pdserve.engine.kv_scale_calibration import calibrated_kv_scales
from pdserve.engine.model import ModelWeights, fuse_weights
from pdserve.engine.output import OutputProcessor
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import Sampler
from pdserve.engine.weights import (
    LoadedModel,
    ModelSpec,
    load_model,
    parse_dtype,
    resolve_device,
    resolve_model,
)
from pdserve.engine.weights.kv_scales import load_kv_cache_spec
from pdserve.kv_transfer.control.server import ListeningReceiver
from pdserve.kv_transfer.registry import get_backend
from pdserve.kv_transfer.wire import dtype_name
from pdserve.prefill_node.batcher import Batcher
from pdserve.prefill_node.engine import PrefillEngine
from pdserve.prefill_node.node import PrefillNode, PrefillNodeConfig
from pdserve.prefill_node.service import PrefillService
from pdserve.protocol.server import DataPlaneServer
from pdserve.settings import ROLES, ModelSettings, WorkerSettings
from pdserve.worker.cache import SummaryReporter, build_tiered, cache_policy_applier, prefix_publisher
from pdserve.worker.control import WorkerControl, nodes_idle
from pdserve.worker.data_plane import WorkerDataPlane
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.router_links import RouterLinks, RouterLinkSettings
from pdserve.worker.transfer import transfer_env

logger = logging.getLogger("pdserve.worker")


def served_model_name(settings: ModelSettings) -> str:
    """The `model` name clients use: what the router and the workers agree on."""
    if settings.served_model_names:
        return settings.served_model_names[0]
    if settings.load_format == "dummy":
        return resolve_model(settings.model_preset or settings.model, "dummy").name
    return resolve_model(settings.model, settings.load_format).name


def load_engine_model(settings: ModelSettings, device: str, dtype: torch.dtype) -> LoadedModel:
    dummy = settings.load_format == "dummy"
    model = (settings.model_preset or settings.model) if dummy else settings.model
    spec = ModelSpec(model, settings.load_format, tokenizer=settings.tokenizer, seed=settings.seed, hub=settings.hub,
                     quantization=settings.quantization)
    loaded = load_model(spec, dtype, device, settings.cache_dir)
    if settings.max_model_len is not None:
        limit = min(settings.max_model_len, loaded.config.max_model_len)
        loaded.config = dataclasses.replace(loaded.config, max_model_len=limit)
    return loaded


@dataclass
class Roles:
    prefill: PrefillNode | None = None
    decode: DecodeNode | None = None


class Worker:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = settings.server.worker_id or f"{settings.role_name}-{uuid.uuid4().hex[:8]}"
        self.device = resolve_device(settings.model.device)
        self.dtype = parse_dtype(None if settings.model.dtype == "auto" else settings.model.dtype, self.device)
        self.model_name = served_model_name(settings.model)
        self.loaded = load_engine_model(settings.model, self.device, self.dtype)
        self.config: ModelConfig = self.loaded.config
        weights = self._fuse_weights()
        self.kv_spec = self._kv_spec(weights)
        # the KV compatibility key (engine/kv_cache_spec.py): in every block hash, tier key and P-D target check
        self.fingerprint = self.kv_spec.fingerprint(self.loaded.fingerprint)
        self.cache_config = self._cache_config()
        self.runner = ModelRunner(self.config, self.cache_config, weights, self.device, self.dtype,
                                  max_num_seqs=settings.scheduler.max_num_seqs,
                                  enforce_eager=settings.model.enforce_eager, kv_spec=self.kv_spec)
        if warmed := self.runner.warm_up_prefill(settings.scheduler.max_num_batched_tokens):
            logger.info("prefill warm-up: %d shapes compiled and run", warmed)
        self.pool = BlockPool(self.cache_config.num_blocks)
        self.prefix_cache = PrefixCache(self.pool, self.cache_config.block_size, settings.cache.enable_prefix_caching)
        self.state_lock = threading.RLock()
        self.tiered = build_tiered(self.prefix_cache, self.runner.kv_caches, self.fingerprint, settings.tiers,
                                   settings.cache_policy, self.device, self.state_lock, settings.server.secret)
        self.summary = SummaryReporter(self.tiered)
        self.model_lock = threading.Lock()
        self.roles = Roles()
        self._build_roles()
        self.metrics = WorkerMetrics(self.model_name, self.roles.prefill, self.roles.decode, self.pool, self.tiered,
                                     self.state_lock)
        self.links = RouterLinks(RouterLinkSettings.of(settings.server, self.worker_id), self,
                                 prefix_publisher(self.tiered), lambda: self.control.left)
        self.control = WorkerControl(settings.roles, not get_backend(settings.transfer.backend).shares_pool, self._idle,
                                     self.links.leave, cache_policy_applier(self.tiered),
                                     cache_policy=settings.cache_policy)
        self.data_plane = WorkerDataPlane(
            PrefillService(self.roles.prefill) if self.roles.prefill is not None else None,
            DecodeService(self.roles.decode) if self.roles.decode is not None else None, self.control)
        self.data_server = DataPlaneServer(self.data_plane, settings.server.secret, self.worker_id)
        self.url = ""

    @property
    def registered(self) -> bool:
        return self.links.registered

    def _idle(self) -> bool:
        return nodes_idle(self.roles.prefill, self.roles.decode, self.state_lock, lambda: self.data_plane.num_open)

    def _fuse_weights(self) -> ModelWeights:
        """The runner's fused weights, built before the KV pool is sized. The HF-named originals of the fused
        q|k|v and gate|up are dropped (and their cache emptied), else a GPU holds them twice: 9.1 GB of
        Llama-3-8B's 16 GB in bf16."""
        fused = fuse_weights(self.config, self.loaded.weights, self.device, self.dtype, self.loaded.quantization)
        self.loaded.weights = {}
        if torch.device(self.device).type == "cuda":
            torch.cuda.empty_cache()
        return fused

    def _kv_spec(self, weights: ModelWeights) -> KVCacheSpec:
        """The pool's dtype and fp8 scales; with --calculate-kv-scales, computed here from the built-in text
        before the pool exists (engine/kv_scale_calibration.py), so every worker of this model has the same."""
        model = self.settings.model
        calibrated = None
        if model.calculate_kv_scales:
            calibrated = calibrated_kv_scales(self.config, weights, self.loaded.tokenizer)
            if torch.device(self.device).type == "cuda":
                torch.cuda.empty_cache()  # the scratch pass's memory, before the pool is sized by what is free
            logger.info("fp8 KV scales calculated from the built-in text: K %s, V %s", calibrated[0], calibrated[1])
        return load_kv_cache_spec(model.kv_cache_dtype, self.dtype, self.loaded, calibrated)

    def _cache_config(self) -> CacheConfig:
        cache = self.settings.cache
        bytes_per_block = self.config.kv_bytes_per_token(self.kv_spec.dtype.itemsize) * cache.block_size
        device = torch.device(self.device)
        if device.type != "cuda" or cache.sized_explicitly:
            return CacheConfig(cache.resolve_num_blocks(bytes_per_block), cache.block_size)
        free, total = torch.cuda.mem_get_info(device)
        budget = gpu_kv_budget(total, free, torch.cuda.memory_reserved(device), cache.gpu_memory_utilization)
        return CacheConfig(cache.resolve_num_blocks(bytes_per_block, budget), cache.block_size)

    def _build_roles(self) -> None:
        """Both nodes over the one pool, whatever the roles: the role admitted can change at run time
        (worker/control.py). Only a colocated worker on the `local` backend builds just its own."""
        backend = get_backend(self.settings.transfer.backend)
        env = transfer_env(self.settings, self.device, self.fingerprint,
                           self.advertised(self.settings.transfer.host))
        built = self.settings.roles if backend.shares_pool else ROLES
        grammars = self._grammar_backend()
        decode_engine = None
        if "decode" in built:
            decode_engine = self._decode_engine()
            receiver = backend.build_receiver(env, self.runner.kv_caches, decode_engine.kv_complete,
                                              decode_engine.kv_failed)
            node_config = DecodeNodeConfig(self.config.max_model_len, self.config.vocab_size,
                                           self.cache_config.block_size, self.settings.scheduler.kv_lease_timeout_s,
                                           self.fingerprint, fetch_lower_tiers=self.settings.colocated)
            self.roles.decode = DecodeNode(decode_engine, receiver, self.loaded.tokenizer, node_config, grammars)
        if "prefill" in built:
            sender = backend.build_sender(env, self.roles.decode.receiver if self.roles.decode is not None else None)
            batcher = Batcher(self.prefix_cache, self.settings.scheduler.max_num_batched_tokens,
                              self.settings.scheduler.max_num_seqs, tiered=self.tiered)
            engine = PrefillEngine(batcher, self.runner, Sampler(self.device), sender, self.state_lock, self.model_lock,
                                   copies_kv=not sender.shares_pool,
                                   hang_step_after=self.settings.faults.hang_step_after)
            prefill_config = PrefillNodeConfig(self.config.max_model_len, self.config.vocab_size,
                                               self.cache_config.block_size, self.config.num_layers,
                                               dtype_name(self.kv_spec.dtype), self.fingerprint,
                                               self.settings.transfer.backend,
                                               self.settings.scheduler.max_queued_requests)
            lookup = self.roles.decode.waiting_reservation if self.roles.decode is not None else None
            self.roles.prefill = PrefillNode(engine, prefill_config, self._output_processor(), self.loaded.tokenizer,
                                             lookup, grammars)

    def _grammar_backend(self) -> GrammarBackend | None:
        """Structured outputs: one grammar compiler (and cache) for both roles; none without a tokenizer."""
        if self.loaded.tokenizer is None:
            return None
        return GrammarBackend(self.loaded.tokenizer, self.config.vocab_size, sorted(self._output_processor().eos_token_ids))

    def _output_processor(self) -> OutputProcessor:
        eos = tuple(self.config.eos_token_ids)
        if self.loaded.tokenizer is not None:
            eos = tuple(dict.fromkeys(eos + tuple(self.loaded.tokenizer.eos_token_ids)))
        return OutputProcessor(eos, self.config.max_model_len)

    def _decode_engine(self) -> DecodeEngine:
        output = self._output_processor()
        # the decode side's reservations take their cached prefix from the worker's one prefix cache: always when
        # colocated (one pool with P), and on a decode worker unless --no-decode-prefix-cache (docs/kv_cache.md)
        reuse = self.settings.colocated or self.settings.cache.decode_prefix_cache
        shared_cache = self.prefix_cache if reuse else None
        limits = self.settings.scheduler
        scheduler = Scheduler(self.pool, self.cache_config.block_size, output, limits.max_num_seqs,
                              limits.watermark_blocks, prefix_cache=shared_cache, tiered=self.tiered,
                              kv_load_failure_policy=limits.kv_load_failure_policy,
                              max_waiting=limits.max_queued_requests,
                              max_local_prefill_tokens=limits.max_num_batched_tokens)
        return DecodeEngine(scheduler, self.runner, Sampler(self.device), self.state_lock, self.model_lock,
                            async_scheduling=limits.async_scheduling,
                            hang_step_after=self.settings.faults.hang_step_after)

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        for node in (self.roles.decode, self.roles.prefill):
            if node is not None:
                await node.start()
        server = self.settings.server
        await self.data_server.start(server.host, server.data_port)

    async def stop(self) -> None:
        await self.data_server.close()
        for node in (self.roles.prefill, self.roles.decode):
            if node is not None:
                await node.stop()
        self.tiered.close()

    @property
    def alive(self) -> bool:
        engines = [n.engine for n in (self.roles.prefill, self.roles.decode) if n is not None]
        return all(engine.alive for engine in engines)

    def step_stalled_s(self) -> float:
        """Seconds since the least recently moving step thread moved (engine/step_liveness.py): the router
        takes a worker whose step threads stopped for --stream-stall-timeout as stalled."""
        engines = [n.engine for n in (self.roles.prefill, self.roles.decode) if n is not None]
        return round(max((engine.progress.stalled_s() for engine in engines), default=0.0), 3)

    def status(self) -> dict[str, Any]:
        """The heartbeat fields. Colocated: queue_len counts both queues, num_running is the decode batch.
        `metrics`: every Prometheus sample of this worker, compact (worker/metrics.py), which the
        router's /metrics carries."""
        parts = [node.status() for node in (self.roles.prefill, self.roles.decode) if node is not None]
        running = self.roles.decode.status() if self.roles.decode is not None else parts[0]
        status = {"worker_id": self.worker_id, "data_port": self.data_server.port, **self.control.status_fields(),
                  "queue_len": sum(p["queue_len"] for p in parts), "num_running": running["num_running"],
                  "num_waiting": sum(p["num_waiting"] for p in parts), "free_blocks": parts[0]["free_blocks"],
                  "total_blocks": parts[0]["total_blocks"], "step_stalled_s": self.step_stalled_s()}
        cache_stats = self.roles.prefill.batcher.cache.stats if self.roles.prefill is not None else None
        if cache_stats is not None and cache_stats.num_hit_blocks + cache_stats.num_miss_blocks:
            status["prefix_hit_rate"] = cache_stats.hit_rate  # none before the first lookup
        if self.roles.prefill is not None and self.roles.prefill.engine.copies_kv:
            stats = self.roles.prefill.engine.stats
            status |= {"transfer_bytes_total": stats.transfer_bytes, "transfer_seconds_total": stats.transfer_seconds}
        return status | self.metrics.console_counts() | {"metrics": self.metrics.compact()}

    def registration(self) -> dict[str, Any]:
        transfer = self.settings.transfer
        port = transfer.port
        if self.roles.decode is not None and isinstance(self.roles.decode.receiver, ListeningReceiver):
            port = self.roles.decode.receiver.port
        return {"worker_id": self.worker_id, "url": self.url, "data_port": self.data_server.port,
                "roles": list(self.control.roles), "roles_version": self.control.roles_version,
                "model": self.model_name, "max_model_len": self.config.max_model_len,
                "block_size": self.cache_config.block_size, "num_blocks": self.cache_config.num_blocks,
                "fingerprint": self.fingerprint,
                "transfer": {"backend": transfer.backend, "host": self.advertised(transfer.host), "port": port}}

    def advertised(self, bind_host: str) -> str:
        """--advertise-host when given, else the address of `bind_host` (its IP for 0.0.0.0)."""
        return self.settings.server.advertise_host or advertised_host(bind_host)


def advertised_host(host: str) -> str:
    """The address others reach a socket bound to `host` at (0.0.0.0 binds everywhere, names nothing)."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host
