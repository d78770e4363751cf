"""Varlen causal attention over packed prefill chunks, keys/values read from the paged KV cache.

prefill_attention(q, kv_cache, cu_seqlens_q, seq_lens, block_tables, scale) -> out
# q: [T, Hq, D] packed; sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1]
# cu_seqlens_q: [B + 1] int32; seq_lens: [B] int32 = cached prefix + this chunk (K/V of the chunk already written)
# block_tables: [B, max_blocks] int32; kv_cache: [2, num_blocks, block_size, Hkv, D]; out: [T, Hq, D]
Row j of sequence i is at absolute position seq_lens[i] - q_len_i + j and sees keys 0..that position (GQA:
query head h reads kv head h // (Hq // Hkv)).
"""

from __future__ import annotations

import torch

from pdserve.kernels.dispatch import use_triton
from pdserve.kernels.paged import attend_ref, gather_sequence_kv


def prefill_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[i], cu[i + 1]
        k, v = gather_sequence_kv(kv_cache, block_tables[i], seq_len)
        out[start:end] = attend_ref(q[start:end], k, v, scale, prefix=seq_len - (end - start))
    return out


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    if use_triton(q):
        from pdserve.kernels.prefill_attention_triton import prefill_attention_triton

        return prefill_attention_triton(q, kv_cache, cu_seqlens_q, seq_lens, block_tables, scale)
    return prefill_attention_ref(q, kv_cache, cu_seqlens_q, seq_lens, block_tables, scale)
