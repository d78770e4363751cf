"""ModelRunner: the model, its KV caches and the static decode buffers of one worker.

Callers speak plain Python per sequence (token ids, positions, block tables from cache_store) and get logits
back; the runner packs them into tensors and runs one forward. Not thread-safe: a node calls it from its one
engine worker thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pdserve.engine.attention_metadata import (
    DecodeBatch,
    DecodeBuffers,
    DecodeInput,
    PrefillChunk,
    build_prefill_batch,
)
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.cuda_graphs import DecodeGraphs, use_cuda_graphs
from pdserve.engine.kv_cache import allocate_kv_caches
from pdserve.engine.kv_cache_spec import KVCacheSpec
from pdserve.engine.model import LayerDone, LlamaModel, ModelWeights, Tick, fuse_weights
from pdserve.engine.prefill_warm_up import warm_up_block_copies, warm_up_chunks, warm_up_limit, warm_up_plan
from pdserve.kernels.host_copy import to_device
from pdserve.kernels.prefill_attention import warm_up_sdpa

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillOutput:
    """logits[j] belongs to chunks[chunk_indices[j]] (the chunks that asked for logits, in order);
    all_logits[i]: every row of chunks[i] when it asked for them (row r predicts the token after its r-th)."""

    logits: torch.Tensor  # [len(chunk_indices), V] fp32
    chunk_indices: list[int]
    num_tokens: int
    all_logits: dict[int, torch.Tensor] = field(default_factory=dict)


def default_decode_buckets(max_num_seqs: int, device: torch.device) -> list[int]:
    """CUDA: 1, 2, 4, then every 8 up to 64, every 16 up to 256, every 32 beyond (one CUDA graph each), so a
    batch pads by at most 7, 15 or 31 rows: with powers of two, batch 192 replayed the 256 graph (10.0 ms on
    the H200 against 7.1 ms at 128; BENCHMARKS.md). CPU: every size, since a padded row costs its full share
    of compute there."""
    if device.type != "cuda":
        return list(range(1, max_num_seqs + 1))
    buckets = [1, 2, 4, *range(8, 65, 8), *range(80, 257, 16), *range(288, max(288, max_num_seqs + 32), 32)]
    return sorted({min(b, max_num_seqs) for b in buckets if b < max_num_seqs} | {max_num_seqs})


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        cache_config: CacheConfig,
        weights: dict[str, torch.Tensor] | ModelWeights,
        device: torch.device | str,
        dtype: torch.dtype,
        max_num_seqs: int = 256,
        decode_buckets: list[int] | None = None,
        enforce_eager: bool = False,
        kv_spec: KVCacheSpec | None = None,
        quantization: str = "none",
    ) -> None:
        """On CUDA the decode step is captured as one CUDA graph per bucket here, once the KV pool exists
        (engine/cuda_graphs.py); `enforce_eager` keeps every step eager (debugging, profiling per kernel).
        `weights` are HF-named, or already fused (a worker fuses first, to size the KV pool by what is left).
        `kv_spec`: the pool's dtype and fp8 scales (engine/kv_cache_spec.py); None: the model's dtype.
        `quantization` is fuse_weights' (HF-named weights only)."""
        self.config = config
        self.cache_config = cache_config
        self.device = torch.device(device)
        self.last_decode_rows = 0  # rows the last decode forward ran (its CUDA-graph bucket)
        self.dtype = dtype
        self.kv_spec = kv_spec if kv_spec is not None else KVCacheSpec(dtype)
        fused = (weights if isinstance(weights, ModelWeights)
                 else fuse_weights(config, weights, self.device, dtype, quantization))
        self.model = LlamaModel(config, fused, self.kv_spec)
        self.kv_caches: list[torch.Tensor] = allocate_kv_caches(config, cache_config, self.device, self.kv_spec.dtype)
        self.max_blocks_per_seq = -(-config.max_model_len // cache_config.block_size)
        self.decode_buffers = DecodeBuffers(
            max_num_seqs,
            self.max_blocks_per_seq,
            cache_config.block_size,
            self.device,
            decode_buckets or default_decode_buckets(max_num_seqs, self.device),
        )
        self.graphs: DecodeGraphs | None = None
        if use_cuda_graphs(self.device, enforce_eager):
            self.graphs = DecodeGraphs(self._forward_decode, self.decode_buffers, self.device)
            self.graphs.capture()

    @torch.inference_mode()  # type: ignore[untyped-decorator]  # torch: not analysed
    def prefill(self, chunks: list[PrefillChunk], layer_done: LayerDone | None = None,
                tick: Tick | None = None) -> PrefillOutput:
        """Run the chunks as one packed batch. layer_done(i) is called once layer i's K/V writes are issued
        (on CUDA: enqueued on the current stream, so a sender records an event there before copying); tick()
        between slices of many logit rows (engine/model.py LOGIT_ROWS_PER_SLICE)."""
        for i, c in enumerate(chunks):
            end = c.start_pos + len(c.token_ids)
            if end > self.config.max_model_len:
                raise ValueError(f"prefill chunk {i} reaches position {end}, beyond max_model_len "
                                 f"{self.config.max_model_len}")
        batch = build_prefill_batch(chunks, self.cache_config.block_size, self.device)
        logits = self.model.forward_prefill(batch, self.kv_caches, layer_done, tick)
        indices = [i for i, c in enumerate(chunks) if c.need_logits]
        num_tokens = int(batch.input_ids.shape[0])
        if not any(c.all_logits for c in chunks):
            return PrefillOutput(logits=logits, chunk_indices=indices, num_tokens=num_tokens)
        rows, sampled, offset = {}, [], 0
        for i, c in enumerate(chunks):
            width = len(c.token_ids) if c.all_logits else int(c.need_logits)
            if c.all_logits:
                rows[i] = logits[offset:offset + width]
            if c.need_logits:
                sampled.append(offset + width - 1)
            offset += width
        index = to_device(sampled, torch.long, self.device)  # long even when empty (no chunk ends here)
        return PrefillOutput(logits[index], indices, num_tokens, rows)

    def prefill_warm_up_batches(self, max_tokens: int) -> list[list[PrefillChunk]]:
        """The warm-up's batches for a token budget of `max_tokens` (engine/prefill_warm_up.py)."""
        bs = self.cache_config.block_size
        limit = warm_up_limit(max_tokens, self.config.max_model_len, self.cache_config.num_blocks, bs)
        return [warm_up_chunks(batch, bs, self.config.vocab_size)
                for batch in warm_up_plan(limit, bs, self.cache_config.num_blocks)]

    def warm_up_prefill(self, max_tokens: int) -> int:
        """Run the prefill warm-up, so that no request waits for a Triton compile (on the H200 serving benchmark
        the first requests' TTFT reached 2.2 s without one). Writes KV into the pool's first blocks, so call it
        before any block is handed out. CPU: nothing to compile, returns 0; else the number of prefills run."""
        if self.device.type != "cuda":
            return 0
        batches = self.prefill_warm_up_batches(max_tokens)
        logger.info("prefill warm-up: %d batches, so no request waits for a Triton compile", len(batches))
        for chunks in batches:
            self.prefill(chunks)
        warm_up_block_copies(self.kv_caches[0])
        planned = self.warm_up_sdpa(max_tokens)
        if planned:
            logger.info("prefill warm-up: SDPA at %d padded prompt lengths (cuDNN plans built now)", planned)
        torch.cuda.synchronize(self.device)
        return len(batches)

    @torch.inference_mode()  # type: ignore[untyped-decorator]  # torch: not analysed
    def warm_up_sdpa(self, max_tokens: int) -> int:
        """SDPA once at each padded length the device's entry gives whole prompts of up to the warm-up's limit
        (kernels/prefill_attention.py warm_up_sdpa): cuDNN's plans, built here instead of on a request.
        Returns the count (0 without an entry). An fp8 cache's prompts run the same calls on their codes."""
        c, bs = self.config, self.cache_config.block_size
        limit = warm_up_limit(max_tokens, c.max_model_len, self.cache_config.num_blocks, bs)
        return warm_up_sdpa(self.device, self.dtype, c.num_heads, c.num_kv_heads, c.head_dim, limit,
                            self.model.scale)

    @torch.inference_mode()  # type: ignore[untyped-decorator]  # torch: not analysed
    def decode(self, items: list[DecodeInput], carried: torch.Tensor | None = None) -> torch.Tensor:
        """One step for each item -> fp32 logits [len(items), V]. With CUDA graphs the rows are a view of the
        bucket's graph output, valid until the next decode call: sample from them first. Nothing here waits
        for the device. `carried`: the previous step's sampled tokens, for items with a `source_row`."""
        if not items:
            raise ValueError("a decode batch needs at least one item")
        for i, it in enumerate(items):
            if it.position >= self.config.max_model_len:
                raise ValueError(f"decode item {i} is at position {it.position}, beyond max_model_len "
                                 f"{self.config.max_model_len}")
        batch = self.decode_buffers.prepare(items, carried)
        self.last_decode_rows = batch.input_ids.shape[0]  # with graphs the bucket: live rows + padding
        if self.graphs is not None:
            return self.graphs.replay(batch)
        return self._forward_decode(batch)[: batch.num_seqs]

    def _forward_decode(self, batch: DecodeBatch) -> torch.Tensor:
        return self.model.forward_decode(batch, self.kv_caches)
