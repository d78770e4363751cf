"""Paged decode attention: one query token per sequence against its whole cached context.

decode_attention(q, kv_cache, seq_lens, block_tables, scale) -> out
# q: [B, Hq, D]; seq_lens: [B] int32 (including the token being decoded, whose K/V is already written)
# block_tables: [B, max_blocks] int32; kv_cache: [2, num_blocks, block_size, Hkv, D]; out: [B, Hq, D]
A sequence with seq_len 0 (a padded CUDA-graph slot) yields zeros.
"""

from __future__ import annotations

import torch

from pdserve.kernels.dispatch import use_triton


def decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """All sequences at once, padded to the longest: a per-sequence loop costs ~10 small ops per sequence and
    layer, which dominated a CPU decode step (batch 16, SmolLM2-135M: 137 ms -> see engine benchmarks)."""
    batch, num_heads, dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    max_len = int(seq_lens.max()) if batch else 0
    if max_len == 0:
        return torch.zeros_like(q)
    num_blocks = (max_len + block_size - 1) // block_size
    blocks = block_tables[:, :num_blocks].long()  # [B, nb]; rows past a sequence's end are masked below
    length = num_blocks * block_size
    k = kv_cache[0, blocks].reshape(batch, length, num_kv_heads, dim).float()
    v = kv_cache[1, blocks].reshape(batch, length, num_kv_heads, dim).float()
    # query head h reads kv head h // group
    qg = q.float().reshape(batch, num_kv_heads, num_heads // num_kv_heads, dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    valid = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgl,blhd->bhgd", torch.softmax(scores, dim=-1), v).reshape(batch, num_heads, dim)
    return torch.where(seq_lens[:, None, None] > 0, out, 0.0).to(q.dtype)  # seq_len 0: softmax gave NaN


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    if use_triton(q):
        from pdserve.kernels.decode_attention_triton import decode_attention_triton

        return decode_attention_triton(q, kv_cache, seq_lens, block_tables, scale)
    return decode_attention_ref(q, kv_cache, seq_lens, block_tables, scale)
