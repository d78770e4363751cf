"""Random prefill batches as a prefill worker's batcher forms them (tests/engine/test_prefill_warm_up.py and
benchmarks/prefill_compiles.py draw the same ones; a plain module: conftest names collide across folders)."""

from __future__ import annotations

import torch

from pdserve.engine.attention_metadata import PrefillChunk

BLOCK = 16
NUM_BLOCKS = 4096


def served_batch(gen: torch.Generator, budget: int, max_model_len: int) -> list[PrefillChunk]:
    """A batch as the batcher forms them: 1-256 chunks, at most `budget` tokens, half after a cached prefix
    (a prefix hit or an earlier chunk), most ending their prompt (logits), block ids anywhere in the pool;
    one batch in five is 1-4 whole new prompts (what SDPA may take)."""
    def draw(high: int) -> int:
        return int(torch.randint(0, high, (1,), generator=gen))

    whole = draw(5) == 0
    num_seqs = 1 + draw(min(4 if whole else 256, budget))
    total = num_seqs + draw(budget - num_seqs + 1)
    cuts = sorted((torch.randperm(total - 1, generator=gen)[: num_seqs - 1] + 1).tolist())
    q_lens = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    chunks = []
    for q_len in q_lens:
        prefix = 0 if whole or draw(2) else draw(max(1, max_model_len - q_len))
        first = draw(NUM_BLOCKS)
        table = [(first + j) % NUM_BLOCKS for j in range(-(-(prefix + q_len) // BLOCK))]
        ids = torch.randint(0, 512, (q_len,), generator=gen).tolist()
        chunks.append(PrefillChunk(ids, prefix, table, need_logits=whole or draw(4) > 0))
    return chunks
