"""CUDA graphs of the decode forward, one per batch bucket, replayed over DecodeBuffers' static tensors.

    capture (once, after the KV pool exists):
        warm-up: every bucket's forward runs eagerly on padding rows (Triton compiles, lookup caches fill)
        capture: largest bucket first, all graphs in one memory pool (a smaller graph's temporaries reuse the
                 blocks the larger one freed; only the logits of each graph stay allocated)
    replay (every step):
        DecodeBuffers.prepare(items) copies the live rows into the buffers' first rows and pads to the bucket
        graph[bucket].replay() ─▶ logits[bucket, V] (the graph's own output tensor) ─▶ rows [:num_seqs]

Why this is safe to replay with other data. Every launch of the decode forward is fixed by shapes alone: the
bucket (rows), the model and the block table's width (DecodeBuffers allocates max_model_len / block_size
columns once). The one data-dependent choice, decode attention's split count
(kernels/decode_attention_triton.num_splits_for), is taken from the batch size and block_tables.shape[1], i.e.
from the bucket and the longest context the buffers allow, never from the live seq_lens; each split finds
its key range on the device. The GEMV configs depend on (rows, N, K) only. Padded rows have slot -1 (the
RoPE/KV-write kernel skips them) and seq_len 0 (decode attention returns zeros for them), so they write no
KV and their logits rows are dropped.

The logits returned by `replay` are a view of the graph's output: valid until the next replay of that
bucket. Callers sample from them before the next step (decode_node/engine.py, pdserve/llm.py both do).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.attention_metadata import DecodeBatch, DecodeBuffers

logger = logging.getLogger(__name__)

DecodeForward = Callable[[DecodeBatch], torch.Tensor]  # batch -> fp32 logits [bucket, V]


def use_cuda_graphs(device: torch.device, enforce_eager: bool) -> bool:
    """Graphs on CUDA unless `enforce_eager`; CPU always runs eagerly (there is no launch overhead to save)."""
    return device.type == "cuda" and not enforce_eager


def capture_order(buckets: list[int]) -> list[int]:
    """Largest first: its temporaries size the shared pool, which every smaller capture then fits into."""
    return sorted(set(buckets), reverse=True)


@dataclass(frozen=True)
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, V] fp32, written by every replay


class DecodeGraphs:
    """The captured decode steps of one ModelRunner. Not thread-safe (the runner is not either)."""

    def __init__(self, forward: DecodeForward, buffers: DecodeBuffers, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.forward = forward
        self.buffers = buffers
        self.device = device
        self.steps: dict[int, CapturedStep] = {}

    @torch.inference_mode()  # type: ignore[untyped-decorator]  # torch: not analysed
    def capture(self, warmup_runs: int = 2) -> None:
        """Warm every bucket up, then capture each; leaves the buffers holding padding rows."""
        order = capture_order(self.buffers.buckets)
        start = time.perf_counter()
        logger.info("capturing %d CUDA graphs of the decode step (batch sizes %d..%d) on %s, once per start",
                    len(order), min(order), max(order), self.device)
        with torch.cuda.device(self.device):
            self._warm_up(order, warmup_runs)
            logger.info("decode warm-up done in %.1f s; capturing", time.perf_counter() - start)
            pool = torch.cuda.graph_pool_handle()
            for done, bucket in enumerate(order, 1):
                batch = self.buffers.padding_batch(bucket)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.forward(batch)
                self.steps[bucket] = CapturedStep(graph, logits)
                logger.debug("captured the graph of batch size %d (%d/%d)", bucket, done, len(order))
            torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs in %.1f s (--enforce-eager skips them)", len(order),
                    time.perf_counter() - start)

    def _warm_up(self, order: list[int], runs: int) -> None:
        # On a side stream, as torch.cuda.graphs recommends: lazy initialisations done here (Triton compiles,
        # cuBLAS handles and workspaces, functools caches of kernel configs) must not happen inside a capture.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bucket in order:
                batch = self.buffers.padding_batch(bucket)
                for _ in range(runs):
                    self.forward(batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def replay(self, batch: DecodeBatch) -> torch.Tensor:
        """batch: what DecodeBuffers.prepare returned -> fp32 logits [batch.num_seqs, V] (a view, see above)."""
        bucket = batch.input_ids.shape[0]
        step = self.steps.get(bucket)
        if step is None:
            raise ValueError(f"no CUDA graph for decode bucket {bucket}; captured {sorted(self.steps)}")
        step.graph.replay()
        return step.logits[: batch.num_seqs]

    @property
    def captured_buckets(self) -> list[int]:
        return sorted(self.steps)
