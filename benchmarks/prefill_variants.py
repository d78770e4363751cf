"""The variants benchmarks/prefill_4096_gpu.py times side by side (its docstring lists them): each selected by
patching module attributes of the prefill-attention dispatcher, the runner's batch build and the BLAS library
(the product is unchanged), and the runners they run on (dummy weights; bf16 or fp8 linears).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
from prefill_baseline_batch import build_prefill_batch_baseline

from pdserve.engine import runner as runner_module
from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.presets import get_preset
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights.dummy import dummy_weights

dispatcher = importlib.import_module("pdserve.kernels.prefill_attention")  # the module (the package exports the function)

PAGE = 16
BUCKET = 256  # the cuDNN variants pad each prompt to a multiple of this (kernels/prefill_attention.py)
BASE = ("ours", "cudnn", "cudnn_contig", "cudnn_nocopy", "flash")
DEFAULT_VARIANTS = (*BASE, "ours_lt", "cudnn_contig_lt")


def sdpa_views_nocopy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: tuple[int, ...], scale: float,
                      backend: str, bucket: int = 0) -> torch.Tensor:
    """One prompt: cuDNN's output handed on as a view, unpadded; several: the shipped loop."""
    if len(q_lens) != 1:
        return SHIPPED_SDPA(q, k, v, q_lens, scale, backend, bucket)
    with dispatcher.sdpa_kernel(dispatcher.SDPA_BACKENDS[backend]):
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def sdpa_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: tuple[int, ...], scale: float,
                    backend: str, bucket: int = 0) -> torch.Tensor:
    """The shipped loop on contiguous [1, H, n, D] copies of q, k, v."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    start = 0
    with dispatcher.sdpa_kernel(dispatcher.SDPA_BACKENDS[backend]):
        for n in q_lens:
            rows = slice(start, start + n)
            qs, ks, vs = (t[rows].transpose(0, 1)[None].contiguous() for t in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                                 enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)
            start += n
    return out


SHIPPED_SDPA = dispatcher.prefill_attention_sdpa
SHIPPED_ENTRY = dispatcher.sdpa_entry
SHIPPED_BUILD = runner_module.build_prefill_batch


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """Patch the dispatcher, the batch build and the BLAS library for one variant; restore on exit."""
    name = name.removesuffix("_queued").removesuffix("_rested")  # how it is timed, not what runs (interleaved)
    name = name.removeprefix("fp8_")  # which runner (fp8 linears), not what the dispatch does
    old_batch = name.startswith("baseline")
    base = name.removeprefix("baseline").removeprefix("_") or "ours"
    base = base.removesuffix("_lt")
    backend = {"ours": None, "flash": "flash"}.get(base, "cudnn")
    entry = None if backend is None else {"backend": backend, "min_tokens": 1, "max_seqs": 1, "bucket": BUCKET}
    sdpa = {"cudnn_contig": sdpa_contiguous, "cudnn_nocopy": sdpa_views_nocopy}.get(base, SHIPPED_SDPA)
    blas = torch.backends.cuda.preferred_blas_library() if torch.cuda.is_available() else None
    dispatcher.sdpa_entry = lambda *args: entry
    dispatcher.prefill_attention_sdpa = sdpa
    if old_batch:
        runner_module.build_prefill_batch = build_prefill_batch_baseline
    try:
        if name.endswith("_lt") and blas is not None:
            torch.backends.cuda.preferred_blas_library("cublaslt")
        yield
    finally:
        dispatcher.sdpa_entry, dispatcher.prefill_attention_sdpa = SHIPPED_ENTRY, SHIPPED_SDPA
        runner_module.build_prefill_batch = SHIPPED_BUILD
        if blas is not None:
            torch.backends.cuda.preferred_blas_library(blas)


def build(preset: str, tokens: int, device: str, dtype: torch.dtype,
          quantizations: tuple[str, ...] = ("none",)) -> tuple[dict[str, ModelRunner], list[PrefillChunk]]:
    """One runner per quantization ("none": bf16 linears; "fp8": fp8 linears, bf16 KV), the same dummy weights."""
    config = get_preset(preset)
    weights = dummy_weights(config, dtype, device)
    runners = {q: ModelRunner(config, CacheConfig(num_blocks=tokens // PAGE + 16, block_size=PAGE), weights, device,
                              dtype, max_num_seqs=1, enforce_eager=True, quantization=q) for q in quantizations}
    del weights
    chunk = PrefillChunk([(7 * j + 3) % config.vocab_size for j in range(tokens)], 0, list(range(-(-tokens // PAGE))))
    return runners, [chunk]


def runner_for(runners: dict[str, ModelRunner], name: str) -> ModelRunner:
    """fp8_* variants run on the fp8-linear runner, the rest on bf16's."""
    return runners["fp8" if name.startswith("fp8_") else "none"]
