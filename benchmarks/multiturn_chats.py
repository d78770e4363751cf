"""The conversations of benchmarks/multiturn_reuse.py: ShareGPT's multi-turn exchanges as token ids, the prompt
of each turn (the history as sent and answered, then the new message), and what the previous turn left on D.

    turn k's prompt = prompt(k-1) + answer(k-1) + sep + message(k)
    held(k)         = (len(prompt(k-1)) + len(answer(k-1)) - 1) // block_size * block_size
                      (D holds the KV of every token it computed: the prompt and the answer but its last token,
                      which was sampled and never fed back; only full blocks are named)
    new blocks(k)   = ceil(len(prompt(k)) / block_size) - held(k) / block_size: the most a delta transfer moves
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.sharegpt import load_sharegpt, sample_sharegpt_multiturn
from pdserve.bench.tokenizer import CountingTokenizer


@dataclass
class Chat:
    """One conversation: its human messages as token ids, max_tokens per turn, and what was sent so far."""

    messages: list[list[int]]
    max_tokens: list[int]
    prompts: list[list[int]] = field(default_factory=list)  # per turn sent
    answers: list[list[int]] = field(default_factory=list)  # per turn answered (re-encoded)
    texts: list[str] = field(default_factory=list)

    def prompt(self, k: int, sep: list[int]) -> list[int]:
        if k == 0:
            return list(self.messages[0])
        return self.prompts[k - 1] + self.answers[k - 1] + sep + self.messages[k]

    def held_tokens(self, k: int, block_size: int) -> int:
        """Tokens of turn k's prompt in the full blocks the previous turn left with KV on D (its prompt and its
        answer but the last token, which has no KV): what a delta transfer need not move."""
        if k == 0:
            return 0
        return (len(self.prompts[k - 1]) + len(self.answers[k - 1]) - 1) // block_size * block_size


@dataclass(frozen=True)
class TurnBound:
    """What turn k's prompts are made of, from the conversations alone (the same on every row)."""

    prompt_tokens: int
    held_tokens: int  # in full blocks D holds from the previous turn
    new_blocks: int  # prompt blocks after those: the most a delta transfer moves

    @classmethod
    def of(cls, chats: list[Chat], k: int, block_size: int) -> TurnBound:
        sent = [c for c in chats if len(c.prompts) > k]
        held = [c.held_tokens(k, block_size) for c in sent]
        blocks = sum(-(-len(c.prompts[k]) // block_size) - h // block_size for c, h in zip(sent, held))
        return cls(sum(len(c.prompts[k]) for c in sent), sum(held), blocks)


def conversations(sharegpt: Path, counting: CountingTokenizer, num: int, seed: int, turns: int, max_context: int,
                  max_output_len: int) -> list[Chat]:
    """`pdserve bench`'s multi-turn ShareGPT sample (>= 2 exchanges each), every human message as token ids,
    max_tokens = the data set's answer length capped at max_output_len."""
    convs = sample_sharegpt_multiturn(load_sharegpt(sharegpt), num, counting, seed, turns, max_context)
    chats = []
    for conv in convs:
        ids = [counting.encode(str(t.prompt), add_special_tokens=False) for t in conv.turns]
        chats.append(Chat(ids, [min(t.output_len, max_output_len) for t in conv.turns]))
    return chats
