"""The batches a prefill worker runs at start, so that no request waits for a Triton compile.

Triton compiles a kernel per launch key (kernels/specialization.py). The kernels do not specialise on what
varies from batch to batch (each `*_triton.py` docstring says what they do specialise on), so two things in
a batch still choose a kernel, and the warm-up runs each of their classes once:

    what chooses                                   warm-up batch
    GEMV config by rows: tuning.BATCH_BUCKETS      b one-token chunks per bucket b: b rows through every
      (layer weights: tokens; LM head: logits        layer weight and b logits rows through the LM head
      rows, i.e. prompts that end in the batch)
    prefill attention tiles by token count         a prompt making the batch 2^k tokens, for every 2^k below
                                                   the limit, and one making it the limit: a threshold
                                                   anywhere in 1..limit is seen from both sides

Each of these batches leads with a one-token chunk after a one-block cached prefix, which keeps it on our
attention kernel whatever the SDPA table says (kernels/prefill_attention.py sends only batches of whole
uncached prompts to SDPA); a last batch, one uncached prompt of the limit, takes the path SDPA may take
(nothing of Triton's to compile there). Where the device's SDPA entry sends whole prompts to cuDNN, which
builds an execution plan per shape on first use (47-52 ms each on the H200), the runner then calls SDPA once
at every padded length a served prompt can run at (kernels/prefill_attention.py `sdpa_buckets`, the function
the dispatch pads by), so no request builds one. Then `warm_up_block_copies` runs the KV-moving kernels a prefill worker
launches per request (kv_transfer's gather or peer copy, the cache tiers' gather / scatter) once each, block 0
onto itself: their keys depend on the pool's layout only, and a peer's pool of another size has strides of the
same class (multiples of 16).

tests/engine/test_prefill_warm_up.py pushes these batches and 200 random served ones (1-256 sequences, up to
the token budget, with and without cached prefixes, ending or not) through the real launchers on shape-only
"meta" tensors and checks that the served keys are among the warm-up's; on a GPU it counts the compiles of
200 random prefills after the warm-up (none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve import kernels
from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.kernels.tuning import BATCH_BUCKETS


@dataclass(frozen=True)
class WarmUpSequence:
    """One sequence of a warm-up batch: `q_len` new tokens after `prefix` cached ones."""

    q_len: int
    prefix: int = 0


def warm_up_limit(max_tokens: int, max_model_len: int, num_blocks: int, block_size: int) -> int:
    """The longest warm-up prompt: the token budget, within the model's length and the pool (less a block)."""
    return max(0, min(max_tokens, max_model_len - 1, (num_blocks - 1) * block_size))


def warm_up_plan(limit: int, block_size: int, num_blocks: int) -> list[list[WarmUpSequence]]:
    """The warm-up batches for prompts of up to `limit` tokens in a pool of `num_blocks` (module docstring)."""
    if limit <= 0:
        return []
    ours = WarmUpSequence(1, block_size)  # blocks 0-1: one cached block, one token after it
    buckets = [b for b in BATCH_BUCKETS if b <= min(limit, num_blocks - 1)]
    plan = [[ours] + [WarmUpSequence(1)] * (b - 1) for b in buckets]  # b tokens, b logits rows
    longest = min(limit, (num_blocks - 2) * block_size + 1)  # what fits beside the continuation's two blocks
    totals, power = [], 2 * buckets[-1]  # the buckets' batches are the powers of two up to theirs
    while power < longest:
        totals.append(power)
        power *= 2
    plan += [[ours, WarmUpSequence(n - 1)] for n in [*totals, longest] if n > buckets[-1]]
    plan.append([WarmUpSequence(limit)])
    return plan


def warm_up_chunks(batch: list[WarmUpSequence], block_size: int, vocab_size: int) -> list[PrefillChunk]:
    """The batch as engine chunks: fixed token ids, the pool's first blocks handed out in order."""
    chunks, next_block = [], 0
    for seq in batch:
        total = seq.prefix + seq.q_len
        table = list(range(next_block, next_block + -(-total // block_size)))
        next_block += len(table)
        ids = [(7 * j + 3) % vocab_size for j in range(seq.prefix, total)]
        chunks.append(PrefillChunk(ids, seq.prefix, table))
    return chunks


def warm_up_block_copies(kv_cache: torch.Tensor) -> None:
    """Gather, scatter and cache-to-cache copy of block 0 onto itself (its contents stay as they are)."""
    ids = torch.zeros(1, dtype=torch.int64, device=kv_cache.device)
    kernels.copy_blocks(kv_cache, ids, kv_cache, ids)
    kernels.scatter_blocks(kv_cache, ids, kernels.gather_blocks(kv_cache, ids))
