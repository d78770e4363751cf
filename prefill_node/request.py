"""One prefill-side request: its state, its prompt, its blocks and where its KV goes.

`state` is written by `Batcher._move` only (prefill_node/batcher.py); everything else reads it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.cache_store.block_pool import blocks_needed
from pdserve.cache_store.tier_reader import FetchedPrefix
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.target import TransferTarget

if TYPE_CHECKING:
    from pdserve.engine.grammar import Matcher


class PrefillState(enum.IntEnum):
    QUEUED = 0  # waiting for blocks and a place in a batch
    PREFILLING = 1  # blocks held (cached prefix + new); chunks being computed, KV pushed layer by layer
    FINISHED = 2  # every token computed, first token sampled and sent with the "done" frame; blocks released
    ABORTED = 3  # /internal/abort or the router went away
    FAILED = 4  # the forward or the transfer failed

    @property
    def finished(self) -> bool:
        return self >= PrefillState.FINISHED


TRANSITIONS: dict[PrefillState, frozenset[PrefillState]] = {
    PrefillState.QUEUED: frozenset({PrefillState.PREFILLING, PrefillState.ABORTED, PrefillState.FAILED}),
    PrefillState.PREFILLING: frozenset({PrefillState.FINISHED, PrefillState.ABORTED, PrefillState.FAILED}),
}


@dataclass
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    target: TransferTarget | None  # D's reservation; set before the request is queued
    block_hashes: list[bytes]  # full prompt blocks, for the prefix cache
    cache_salt: str | None = None
    state: PrefillState = PrefillState.QUEUED
    block_ids: list[int] = field(default_factory=list)
    blocks_preassigned: bool = False  # colocated: D's reserved blocks, with a reference of our own
    num_cached_tokens: int = 0  # found in the prefix cache (device, or loaded from host RAM / Redis), not computed
    fetched: FetchedPrefix | None = None  # host / Redis blocks staged for it before it was queued; used at admission
    num_computed_tokens: int = 0  # cached + computed so far
    error: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    grammar: Matcher | None = None  # structured outputs: masks the first token
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # [None, entry(t1), ...], filled chunk by chunk

    def __post_init__(self) -> None:
        if self.sampling.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Every prompt token's logits are needed: the prefix cache is skipped (it holds no logits)."""
        return self.sampling.prompt_logprobs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def remaining(self) -> int:
        return self.num_prompt_tokens - self.num_computed_tokens

    @property
    def num_uncarried_blocks(self) -> int:
        """Leading blocks the receiver already has (its own prefix cache's; colocated: the shared one), never sent."""
        assert self.target is not None, "a queued request has its target"
        return blocks_needed(self.num_prompt_tokens, self.target.block_size) - len(self.target.block_ids)

    @property
    def num_carried_tokens(self) -> int:
        """Tokens whose K/V the transfer carries (the "done" frame's num_tokens)."""
        assert self.target is not None, "a queued request has its target"
        return self.num_prompt_tokens - self.num_uncarried_blocks * self.target.block_size
