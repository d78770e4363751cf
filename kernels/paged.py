"""Reading one sequence's keys and values out of the paged KV cache (shared by the attention references)."""

from __future__ import annotations

import torch

from pdserve.kernels.fp8 import fp8_k_tokens, fp8_v_tokens


def gather_sequence_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache: [2, num_blocks, block_size, Hkv, D]; block_table: [max_blocks] -> k, v: [seq_len, Hkv, D]

    token t of the sequence lives in block block_table[t // block_size] at offset t % block_size.
    """
    block_size = kv_cache.shape[2]
    num = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num].long()
    k = fp8_k_tokens(kv_cache[0, blocks]).reshape(-1, *kv_cache.shape[3:])[:seq_len]  # an fp8 cache's layouts
    v = fp8_v_tokens(kv_cache[1, blocks]).reshape(-1, *kv_cache.shape[3:])[:seq_len]
    return k, v


# Query rows per block of attend_ref: a block's scores ([Hq, 128, keys] fp32) stay in cache, and each block reads
# only the keys its last row can see, so a whole prompt costs about half the full [Tq, Tk] product.
ATTEND_BLOCK_ROWS = 128


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, prefix: int) -> torch.Tensor:
    """q: [Tq, Hq, D], k/v: [Tk, Hkv, D]; query j sits at absolute position prefix + j (causal). fp32 math.

    In blocks of ATTEND_BLOCK_ROWS query rows (the CPU serving path runs this reference: over the whole
    [Hq, Tq, Tk] at once, a 1,000-token prompt's attention took ~2.5x as long, most of a CPU prefill)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    qf = q.float().transpose(0, 1)  # [Hq, Tq, D]
    out = torch.empty(qf.shape, dtype=torch.float32, device=q.device)
    for start in range(0, q.shape[0], ATTEND_BLOCK_ROWS):
        end = min(start + ATTEND_BLOCK_ROWS, q.shape[0])
        seen = min(prefix + end, k.shape[0])  # keys the block's last row sees
        scores = torch.bmm(qf[:, start:end], kf[:, :seen].transpose(1, 2)) * scale
        q_pos = torch.arange(start, end, device=q.device)[:, None] + prefix
        k_pos = torch.arange(seen, device=q.device)[None, :]
        probs = torch.softmax(scores.masked_fill_(k_pos > q_pos, float("-inf")), dim=-1)
        out[:, start:end] = torch.bmm(probs, vf[:, :seen])
    return out.transpose(0, 1).to(q.dtype)
