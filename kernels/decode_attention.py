"""Paged decode attention: one query token per sequence against its whole cached context.

decode_attention(q, kv_cache, seq_lens, block_tables, scale) -> out
# q: [B, Hq, D]; seq_lens: [B] int32 (including the token being decoded, whose K/V is already written)
# block_tables: [B, max_blocks] int32; kv_cache: [2, num_blocks, block_size, Hkv, D]; out: [B, Hq, D]
A sequence with seq_len 0 (a padded CUDA-graph slot) yields zeros.
k_scale, v_scale: the layer's fp8 scales; an fp8 kv_cache is read as fp8 * scale (kernels/fp8.py), others as is.
"""

from __future__ import annotations

import torch

from pdserve.kernels.dispatch import use_triton
from pdserve.kernels.fp8 import dequantize_kv_ref, fp8_k_tokens, fp8_v_tokens


def decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """All sequences at once, padded to the longest: one block gather for K and V, then torch's fused attention.

    The G query heads of a kv head act as G query rows of one head (no GQA expansion), keys past a sequence's
    end are masked. Gathering with index_select (a copy per block) and letting SDPA read K/V through strided
    views replaced fancy indexing plus two einsums, whose permute copies and element-wise gathers were 56% of
    a CPU decode step (SmolLM2-135M, batch 17, context ~250: 5.6 ms -> 2.0 ms per layer on one thread;
    benchmarks/decode_step_cpu.py). A per-sequence loop costs ~10 small ops per sequence and layer."""
    batch, num_heads, dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    max_len = int(seq_lens.max()) if batch else 0
    if max_len == 0:
        return torch.zeros_like(q)
    num_blocks = (max_len + block_size - 1) // block_size
    length = num_blocks * block_size
    blocks = block_tables[:, :num_blocks].reshape(-1).long()  # rows past a sequence's end are masked below
    kv = kv_cache.index_select(1, blocks)
    k = dequantize_kv_ref(fp8_k_tokens(kv[0]), k_scale).reshape(batch, length, num_kv_heads, dim)
    k = k.contiguous().transpose(1, 2)  # [B, Hkv, L, D]; an fp8 cache's K and V come permuted (kernels/fp8.py):
    v = dequantize_kv_ref(fp8_v_tokens(kv[1]), v_scale).reshape(batch, length, num_kv_heads, dim)
    v = v.contiguous().transpose(1, 2)  # contiguous, as SDPA sums in another order on other strides
    qg = q.float().reshape(batch, num_kv_heads, num_heads // num_kv_heads, dim)  # query head h: kv head h // G
    valid = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    out = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    out = out.reshape(batch, num_heads, dim)
    return torch.where(seq_lens[:, None, None] > 0, out, 0.0).to(q.dtype)  # seq_len 0: every key masked


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    if use_triton(q):
        from pdserve.kernels.decode_attention_triton import decode_attention_triton

        return decode_attention_triton(q, kv_cache, seq_lens, block_tables, scale, k_scale, v_scale)
    return decode_attention_ref(q, kv_cache, seq_lens, block_tables, scale, k_scale, v_scale)
