"""Reading one sequence's keys and values out of the paged KV cache (shared by the attention references)."""

from __future__ import annotations

import torch


def gather_sequence_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache: [2, num_blocks, block_size, Hkv, D]; block_table: [max_blocks] -> k, v: [seq_len, Hkv, D]

    token t of the sequence lives in block block_table[t // block_size] at offset t % block_size.
    """
    block_size = kv_cache.shape[2]
    num = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num].long()
    k = kv_cache[0, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    v = kv_cache[1, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    return k, v


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, prefix: int) -> torch.Tensor:
    """q: [Tq, Hq, D], k/v: [Tk, Hkv, D]; query j sits at absolute position prefix + j (causal). fp32 math."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    q_pos = torch.arange(q.shape[0], device=q.device)[:, None] + prefix
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)
