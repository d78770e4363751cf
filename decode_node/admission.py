"""The decode scheduler's admission and preemption rules, as arithmetic over block counts.

    reserve     prompt + 1 blocks (the first token's K/V is written by D's first step); refused while a
                preempted request waits (it goes first) or when it would leave fewer than `watermark_blocks`
    resume      a preempted request takes blocks for all its tokens, plus the watermark while others run (they
                must still grow); with nothing running it may take the last block
    admit       a request whose KV is here runs once fewer than `max_num_seqs` do
    preempt     when a running request cannot grow, the newest running one gives its blocks back

Used by decode_node/scheduler.py, which asks these questions of its block pool (and prefix cache), and by the
planner's simulated decode worker (planner/sim_workers.py), which asks them of a free-block counter:
one definition of the policy. Torch-free, so the planner imports it cheaply.
"""

from __future__ import annotations

from collections.abc import Callable, Reversible
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class DecodeAdmission:
    block_size: int
    max_num_seqs: int
    watermark_blocks: int = 1

    def reservation_blocks(self, num_prompt_tokens: int) -> int:
        return -(-(num_prompt_tokens + 1) // self.block_size)

    def may_reserve(self, num_blocks: int, num_preempted: int, fits: Callable[[int], bool]) -> bool:
        """`fits(n)`: whether n blocks can be taken now (the pool's free ones, or evictable cache too)."""
        return num_preempted == 0 and fits(num_blocks + self.watermark_blocks)

    def resume_blocks(self, num_blocks: int, num_running: int) -> int:
        """Blocks that must be free to resume a preempted request needing `num_blocks`."""
        return num_blocks + (self.watermark_blocks if num_running else 0)

    def has_slot(self, num_running: int) -> bool:
        return num_running < self.max_num_seqs

    @staticmethod
    def victim(running: Reversible[T]) -> T:
        """The request preempted when blocks run out: the newest admitted (`running` in admission order)."""
        return next(reversed(running))
