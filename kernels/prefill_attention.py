"""Varlen causal attention over packed prefill chunks, keys/values read from the paged KV cache.

prefill_attention(q, kv_cache, cu_seqlens_q, seq_lens, block_tables, scale, k=None, v=None, shape=None) -> out
# q: [T, Hq, D] packed; sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1]
# cu_seqlens_q: [B + 1] int32; seq_lens: [B] int32 = cached prefix + this chunk (K/V of the chunk already written)
# block_tables: [B, max_blocks] int32; kv_cache: [2, num_blocks, block_size, Hkv, D]; out: [T, Hq, D]
# k, v: [T, Hkv, D] the chunks' own rotated keys and values (optional); shape: what the host knows (optional)
# k_scale, v_scale: the layer's fp8 scales; an fp8 kv_cache is read as fp8 * scale (kernels/fp8.py)
Row j of sequence i is at absolute position seq_lens[i] - q_len_i + j and sees keys 0..that position (GQA:
query head h reads kv head h // (Hq // Hkv)).

Which kernel (issue 23: never slower than the library). On CUDA, ours (prefill_attention_triton) reads K/V
from the pages, so it serves every batch: cached prefixes, chunked continuations, many short prompts. Where
a batch is whole uncached prompts, their K/V are exactly k and v (contiguous per prompt), and torch SDPA
(FlashAttention / cuDNN / memory-efficient, through torch.nn.attention.sdpa_kernel) can run on them instead:
`sdpa_choice` sends such a batch there when the device's entry in tuning.PREFILL_PATH says so (the backend,
the shortest prompt it wins from, the most prompts per batch: one SDPA call each, and the row bucket). Without
an entry ours runs everywhere; off CUDA everything is the reference.

cuDNN builds an execution plan for every new shape on its first use (47-52 ms at 512-8,192 tokens, up to
591 ms for the first one of a process: prefill_attention_sdpa.json, prefill_sdpa_buckets_h200.json), and
served prompt lengths rarely repeat: a compile on the request path (issue 23, item 1). So each prompt runs
at `sdpa_bucket(n, bucket)` rows, n rounded up to a multiple of the entry's bucket, in the fused qkv layout
(_sdpa_prompt: real rows first, zeros after; causal, so the real rows' outputs are the unpadded call's), and
the worker's warm-up (engine/runner.py warm_up_sdpa) runs SDPA once at every `sdpa_buckets` length up to its
token budget, the same function the dispatch pads by. A 4,096-token prompt is a bucket: no copy at all.

Where each wins on the H200 (2026-12-03, `OUT=dir bash benchmarks/issue23_cudnn_buckets_h200.sh`), Llama-3-8B
heads (32 q / 8 kv, d 128), bf16:
- one layer's attention, one whole prompt (results/prefill_sdpa_buckets_h200.json, do_bench medians, us):
  ours vs padded cuDNN: 1,024 42.2 vs 34.4; 1,100 (at 1,280) 51.5 vs 86.0; 1,280 60.8 vs 44.3; 1,536 78.0 vs
  56.4; 2,048 120.5 vs 86.0; 3,000 (at 3,072) 227.1 vs 182.9; 4,096 385.3 vs 262.7; 8,000 (at 8,192) 1,403 vs
  1,025. Padded cuDNN wins at 1,280 and every longer length measured, hence the entry (min_tokens 1,280,
  bucket 256, one prompt a batch; the entry file names its command). Below that, and for packed batches
  (2 x 2,048: ours 223 vs 264 us; 8 x 512: 116 vs 863) and cached prefixes, ours (prefill_attention_sdpa.json).
  After the warm-up (29 buckets from 1,024 to 8,192: 2.3 s once), every length's first call took 0.3-1.2 ms
  (a second 0.1-1.1), against 42-591 ms unpadded; after a worker's warm_up_prefill, whole llama3-8b prefills
  of 8 random lengths (1,374-4,265) took 0.7-7.8 ms more on their first call than on a second, none the
  ~50 ms of a plan (results/prefill_clocks_h200.json served_after_warm_up): the same kernels, GPU time and
  runtime calls, the GPU idle while cuBLAS picks its GEMMs for the new row count (2.7-3.5 ms a shape on a
  first call: results/gemm_first_call_h200.log), which ours pays alike. The padding costs a padded
  length's attention (8,000: 1,025 us padded against 865 unpadded) and one copy of the rows.
- the whole 4,096-token llama3-8b prefill (results/prefill_4096_buckets_gpu.json, 4 rounds x 5 interleaved;
  benchmarks/prefill_4096_gpu.py): ours 101.81 ms median, cuDNN 101.36 back to back; 96.14 / 92.94 after an
  80 ms GPU rest; 94.84 / 91.90 queued behind a GPU sleep (the GPU's own time). Attention 13.0 ms of ours
  against 10.1 of cuDNN's (profiled). With fp8 linears: 66.41 / 63.96 back to back, 60.87 / 57.17 queued.
  Back to back the card sits at its 700 W cap (sw_power_cap in 97 % of NVML samples, SM clock 1,485 MHz
  against 1,740 rested: results/prefill_clocks_h200.json), which takes most of the gain back.
An fp8 cache goes to SDPA too, but not with k and v: those are the unquantized values, and attending to them
would give a prompt other numbers than its decode steps, which read the fp8 cache. prefill_attention_sdpa_fp8
gathers each prompt's codes from its blocks (what decode reads; e4m3 is exact in bf16 and fp16) and folds the
layer's scales in: K's into q as q is copied into the padded buffer (so the softmax scale stays the model's:
some torch builds key cuDNN's plans by it), V's into the output. Before it, an fp8 cache always ran ours: the
4,096-token llama3-8b prefill with an fp8 cache took 111.8 ms against 102.3 with bf16's (fp8 linears 76.9
against 65.3; H100, one call, results/engine_gpu_four_settings_h100.json); with it 101.1 against 98.2 (67.1
against 63.5; another call, results/engine_gpu_fp8kv_sdpa2_h100.json): q's copy into the padded buffer and the
codes' gather remain.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pdserve.kernels.dispatch import use_triton
from pdserve.kernels.fp8 import dequantize_kv_ref, fp8_k_tokens, fp8_v_tokens, is_fp8
from pdserve.kernels.paged import attend_ref, gather_sequence_kv
from pdserve.kernels.tuning import default_prefill_table, device_name, prefill_key

SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


@dataclass(frozen=True)
class PrefillShape:
    """What the host knows of a packed batch from its chunks, without reading the device."""

    q_lens: tuple[int, ...]
    cached: bool  # some chunk follows tokens already in the cache (a prefix hit, an earlier chunk)


def sdpa_choice(shape: PrefillShape | None, entry: dict[str, Any] | None) -> str | None:
    """The SDPA backend for this batch, or None for ours: only whole uncached prompts, each of at least
    entry["min_tokens"] tokens, at most entry["max_seqs"] (default 1) of them."""
    if shape is None or entry is None or shape.cached or not shape.q_lens:
        return None
    if len(shape.q_lens) > entry.get("max_seqs", 1) or min(shape.q_lens) < entry["min_tokens"]:
        return None
    return entry["backend"]


def sdpa_bucket(n: int, step: int) -> int:
    """The length a prompt of n tokens runs SDPA at: n rounded up to a multiple of `step` (0: n itself).
    cuDNN builds an execution plan per shape on first use (47-52 ms); padded to buckets, served lengths reuse
    the plans the warm-up built (sdpa_buckets)."""
    return -(-n // step) * step if step > 0 else n


def sdpa_buckets(entry: dict[str, Any] | None, limit: int) -> list[int]:
    """Every length sdpa_bucket gives the prompts of entry["min_tokens"]..limit tokens: what the warm-up runs
    (engine/runner.py warm_up_prefill), so that no served prompt meets a shape cuDNN has not planned."""
    if entry is None or limit < entry["min_tokens"]:
        return []
    step = entry.get("bucket", 0)
    if step <= 0:
        return list(range(entry["min_tokens"], limit + 1))
    return list(range(sdpa_bucket(entry["min_tokens"], step), sdpa_bucket(limit, step) + 1, step))


@functools.cache
def sdpa_entry(device: torch.device, dtype: torch.dtype, q_heads: int, kv_heads: int,
               head_dim: int) -> dict[str, Any] | None:
    """This device and head shape's measured entry (None: ours everywhere)."""
    return default_prefill_table().entries.get(prefill_key(device_name(device), dtype, q_heads, kv_heads, head_dim))


def _fused_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """q|k|v as one [n, Hq + 2 Hkv, D] view when they are adjacent heads of one fused qkv row (what the model
    passes: the qkv GEMM's output split), else None."""
    n, hq, d = q.shape
    heads = hq + 2 * k.shape[1]
    fused = (heads * d, d, 1)
    if q.stride() != fused or k.stride() != fused or v.stride() != fused:
        return None
    size = q.element_size()
    if k.data_ptr() != q.data_ptr() + hq * d * size or v.data_ptr() != k.data_ptr() + k.shape[1] * d * size:
        return None
    return q.as_strided((n, heads, d), fused)


def _sdpa_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, step: int) -> torch.Tensor:
    """One causal prompt [n, H, D] -> [n, Hq, D], run at sdpa_bucket(n, step) rows in the fused layout
    [L, Hq + 2 Hkv, D] (the model's qkv row), so cuDNN's plan key (dims and strides) is the bucket's whatever n
    is. Rows n..L are zeros, appended at the end: with the causal mask row i < n sees keys 0..i, all real,
    so the real rows' outputs are those of the unpadded call; the padded rows' outputs are dropped. (The
    zeros matter: a masked key still enters P @ V with weight 0, and 0 * NaN from stale memory is NaN.)"""
    n, hq, d = q.shape
    hkv = k.shape[1]
    rows = sdpa_bucket(n, step)
    fused = _fused_rows(q, k, v)
    if rows != n or fused is None:
        buf = torch.empty(rows, hq + 2 * hkv, d, dtype=q.dtype, device=q.device)
        if fused is not None:
            buf[:n].copy_(fused)  # one copy of the fused rows (q, k, v are adjacent)
        else:
            buf[:n, :hq], buf[:n, hq:hq + hkv], buf[:n, hq + hkv:] = q, k, v
        buf[n:].zero_()
        q, k, v = buf.split([hq, hkv, hkv], dim=1)
    qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, L, D]
    o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)[:n]


def _each_prompt(q: torch.Tensor, q_lens: tuple[int, ...], backend: str,
                 attend: Callable[[int, slice], torch.Tensor]) -> torch.Tensor:
    """attend(i, rows) for each prompt i of the packed batch, under `backend`: one prompt's output handed on as
    it is (a view, no copy into a packed buffer), several copied into one [T, Hq, D]."""
    with sdpa_kernel(SDPA_BACKENDS[backend]):
        if len(q_lens) == 1:
            return attend(0, slice(0, q_lens[0]))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        start = 0
        for i, n in enumerate(q_lens):
            out[start:start + n] = attend(i, slice(start, start + n))
            start += n
    return out


def prefill_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: tuple[int, ...],
                           scale: float, backend: str, bucket: int = 0) -> torch.Tensor:
    """Whole uncached prompts packed along T: one causal SDPA call per prompt (GQA through enable_gqa, no K/V
    expansion), each padded up to a multiple of `bucket` rows (_sdpa_prompt)."""
    return _each_prompt(q, q_lens, backend, lambda i, rows: _sdpa_prompt(q[rows], k[rows], v[rows], scale, bucket))


def _sdpa_prompt_fp8(q: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, scale: float, k_scale: float,
                     step: int) -> torch.Tensor:
    """One causal prompt [n, Hq, D] over its fp8 blocks: q times k_scale and the blocks' codes (widened to q's
    dtype, exact; token order through kernels/fp8.py's layouts) written, whole blocks at a time, into
    _sdpa_prompt's padded fused layout, the rows past n zeroed after, then _sdpa_prompt on its views (no further
    copy)."""
    n, hq, d = q.shape
    page, hkv = kv_cache.shape[2], kv_cache.shape[3]
    num = -(-n // page)
    rows, heads = sdpa_bucket(n, step), hq + 2 * hkv
    buf = torch.empty(max(rows, num * page), heads, d, dtype=q.dtype, device=q.device)
    if k_scale != 1.0:
        torch.mul(q, k_scale, out=buf[:n, :hq])
    else:
        buf[:n, :hq] = q
    whole = buf[: num * page].view(num, page, heads, d)
    ids = blocks[:num].long()
    whole[:, :, hq:hq + hkv] = fp8_k_tokens(kv_cache[0, ids])
    whole[:, :, hq + hkv:] = fp8_v_tokens(kv_cache[1, ids])
    buf[n:].zero_()
    qs, ks, vs = buf[:rows].split([hq, hkv, hkv], dim=1)
    return _sdpa_prompt(qs, ks, vs, scale, step)[:n]


def prefill_attention_sdpa_fp8(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               q_lens: tuple[int, ...], scale: float, k_scale: float, v_scale: float, backend: str,
                               bucket: int = 0) -> torch.Tensor:
    """Whole uncached prompts over an fp8 cache (their K/V already written): each prompt's codes read from its
    blocks, q times k_scale (_sdpa_prompt_fp8), the output times v_scale; one SDPA call per prompt at the
    model's softmax scale, padded as prefill_attention_sdpa's."""
    out = _each_prompt(q, q_lens, backend, lambda i, rows: _sdpa_prompt_fp8(q[rows], kv_cache, block_tables[i],
                                                                            scale, k_scale, bucket))
    if v_scale != 1.0:
        out *= v_scale
    return out


def warm_up_sdpa(device: torch.device, dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int,
                 limit: int, scale: float) -> int:
    """Run SDPA once at every bucket this device's entry gives prompts of up to `limit` tokens (sdpa_buckets),
    through the served path, so that cuDNN's plans are built here and not on a request. Returns the count."""
    entry = sdpa_entry(device, dtype, q_heads, kv_heads, head_dim)
    buckets = sdpa_buckets(entry, limit)
    if not buckets:
        return 0
    assert entry is not None
    qkv = torch.randn(buckets[-1], q_heads + 2 * kv_heads, head_dim, dtype=dtype, device=device)
    for rows in buckets:
        q, k, v = qkv[:rows].split([q_heads, kv_heads, kv_heads], dim=1)
        prefill_attention_sdpa(q, k, v, (rows,), scale, entry["backend"], entry.get("bucket", 0))
    return len(buckets)


def prefill_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[i], cu[i + 1]
        k, v = gather_sequence_kv(kv_cache, block_tables[i], seq_len)
        k, v = dequantize_kv_ref(k, k_scale), dequantize_kv_ref(v, v_scale)
        out[start:end] = attend_ref(q[start:end], k, v, scale, prefix=seq_len - (end - start))
    return out


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    shape: PrefillShape | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    if use_triton(q):
        if k is not None and v is not None and shape is not None:
            entry = sdpa_entry(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2])
            backend = sdpa_choice(shape, entry)
            if backend is not None:
                assert entry is not None
                if is_fp8(kv_cache.dtype):
                    return prefill_attention_sdpa_fp8(q, kv_cache, block_tables, shape.q_lens, scale, k_scale,
                                                      v_scale, backend, entry.get("bucket", 0))
                return prefill_attention_sdpa(q, k, v, shape.q_lens, scale, backend, entry.get("bucket", 0))
        from pdserve.kernels.prefill_attention_triton import prefill_attention_triton

        return prefill_attention_triton(q, kv_cache, cu_seqlens_q, seq_lens, block_tables, scale, k_scale, v_scale)
    return prefill_attention_ref(q, kv_cache, cu_seqlens_q, seq_lens, block_tables, scale, k_scale, v_scale)
