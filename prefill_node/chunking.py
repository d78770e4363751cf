"""How many prompt tokens of one request go into a forward: the prefill batcher's chunk choice, as arithmetic.

    budget 40, block_size 16, 100 tokens left from token 20:
        all that remain do not fit ─▶ 20 + 40 = 60 ─▶ back to the block edge 48 ─▶ 28 tokens
        (a block split between two forwards would be sent to D twice)
    budget 10 from token 20: no block edge in reach (20 + 10 < 32) ─▶ 10 tokens, the split is paid

Used by prefill_node/batcher.py and by the planner's simulated prefill worker (pdserve/planner/sim_workers.py),
so the plan chunks prompts as the real worker does. Torch-free, so the planner imports it cheaply.
"""

from __future__ import annotations


def chunk_tokens(num_computed: int, remaining: int, budget: int, block_size: int) -> int:
    """Tokens of a request with `num_computed` tokens done and `remaining` to go, in a forward with `budget`
    tokens left: all that remain if they fit, else a chunk that ends on a block edge when one is in reach."""
    take = min(remaining, budget)
    if take < remaining:
        end = (num_computed + take) // block_size * block_size
        if end > num_computed:
            take = end - num_computed
    return take
