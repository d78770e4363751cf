"""How many prompt tokens of one request go into a forward: the prefill batcher's chunk choice, as arithmetic.

    budget 40, block_size 16, 100 tokens left from token 20:
        all that remain do not fit ─▶ 20 + 40 = 60 ─▶ back to the block edge 48 ─▶ 28 tokens
        (a block split between two forwards would be sent to D twice)
    budget 10 from token 20: no block edge in reach (20 + 10 < 32) ─▶ 10 tokens, the split is paid

Used by prefill_node/batcher.py and by the planner's simulated prefill worker (planner/sim_workers.py),
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


class QueuedAdmission:
    """The order in which queued prompts take a forward's budget, as arithmetic (one per forward).

        for each queued prompt, in arrival order:
            room() false                            ─▶ stop
            goes_before_partial(n) false            ─▶ stop: only whole prompts go before the partial one
            (admit it: blocks, slots)
            takes_now(n) false                      ─▶ it is the first that gets only part of its prompt:
                                                       half of what was left is kept for it, its chunk last
            else spend(its chunk)
        then the partial one's chunk from what is left

    So a short prompt is not kept a whole forward behind a long one's first chunk, and the long one still gets
    at least half. The batcher (prefill_node/batcher.py) and the planner's simulated P both follow it."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.reserve = 0  # kept for the partial prompt
        self.has_partial = False

    def room(self) -> bool:
        return self.budget - self.reserve > 0

    def goes_before_partial(self, num_prompt_tokens: int) -> bool:
        return not self.has_partial or num_prompt_tokens <= self.budget - self.reserve

    def takes_now(self, remaining: int) -> bool:
        if not self.has_partial and remaining > self.budget:
            self.has_partial, self.reserve = True, (self.budget + 1) // 2
            return False
        return True

    def spend(self, take: int) -> None:
        self.budget -= take
