"""Paged decode attention: one query token per sequence against its whole cached context.

decode_attention(q, kv_cache, seq_lens, block_tables, scale) -> out
# q: [B, Hq, D]; seq_lens: [B] int32 (including the token being decoded, whose K/V is already written)
# block_tables: [B, max_blocks] int32; kv_cache: [2, num_blocks, block_size, Hkv, D]; out: [B, Hq, D]
A sequence with seq_len 0 (a padded CUDA-graph slot) yields zeros.
"""

from __future__ import annotations

import torch

from pdserve.kernels.dispatch import use_triton
from pdserve.kernels.paged import attend_ref, gather_sequence_kv


def decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k, v = gather_sequence_kv(kv_cache, block_tables[i], seq_len)
        out[i : i + 1] = attend_ref(q[i : i + 1], k, v, scale, prefix=seq_len - 1)
    return out


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
