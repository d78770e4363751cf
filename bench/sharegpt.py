"""ShareGPT-format conversations (a JSON list of {"conversations": [{"from": "human"|"gpt", "value": str}, ...]}),
plain or gzipped, read the way `vllm bench serve --dataset-name sharegpt` reads them:

  the prompt is the first human turn and the output length is the token count of the gpt turn that answers it
  (or --sharegpt-output-len); pairs with a prompt or output under 4 tokens, a prompt over 1024 tokens or a
  total over 2048 tokens are skipped; the data set is shuffled with the seed and the first N valid pairs taken.

Multi-turn conversations keep every human turn (up to max_turns) with the length of the gpt answer that
followed it, while the running context stays within max_context tokens.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.datasets import Conversation, Turn
from pdserve.bench.tokenizer import CountingTokenizer

MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class Exchange:
    """A human message and the gpt answer that followed it."""

    human: str
    gpt: str


def load_sharegpt(path: str | Path) -> list[list[Exchange]]:
    """Every conversation as its (human, gpt) exchanges in order; a file ending in .gz is decompressed."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise TypeError(f"{path}: a ShareGPT file is a JSON list of conversations, got {type(data).__name__}")
    return [_exchanges(entry.get("conversations", [])) for entry in data]


def _exchanges(turns: list[dict[str, Any]]) -> list[Exchange]:
    out: list[Exchange] = []
    pending: str | None = None
    for turn in turns:
        role, value = turn.get("from"), turn.get("value", "")
        if role == "human":
            pending = value
        elif role == "gpt" and pending is not None:
            out.append(Exchange(pending, value))
            pending = None
    return out


def is_valid_pair(prompt_len: int, output_len: int, fixed_output_len: bool) -> bool:
    """vLLM's filter: no prompt (or output, unless fixed) under 4 tokens, prompt <= 1024, total <= 2048."""
    too_short = prompt_len < MIN_LEN or (not fixed_output_len and output_len < MIN_LEN)
    return not too_short and prompt_len <= MAX_PROMPT_LEN and prompt_len + output_len <= MAX_TOTAL_LEN


def sample_sharegpt(
    conversations: list[list[Exchange]],
    num: int,
    tokenizer: CountingTokenizer,
    seed: int,
    output_len: int | None = None,
) -> list[Conversation]:
    """Single-turn requests from each conversation's first exchange."""
    firsts = [c[0] for c in conversations if c]
    random.Random(seed).shuffle(firsts)
    picked: list[Conversation] = []
    for ex in firsts:
        if len(picked) == num:
            break
        prompt_len = len(tokenizer.encode(ex.human, add_special_tokens=False))
        out_len = output_len or len(tokenizer.encode(ex.gpt, add_special_tokens=False))
        if is_valid_pair(prompt_len, out_len, output_len is not None):
            picked.append(Conversation((Turn(ex.human, prompt_len, out_len),)))
    if len(picked) < num:
        raise ValueError(f"the ShareGPT file has {len(picked)} valid first exchanges; asked for {num}")
    return picked


def sample_sharegpt_multiturn(
    conversations: list[list[Exchange]],
    num: int,
    tokenizer: CountingTokenizer | None,
    seed: int,
    max_turns: int = 4,
    max_context: int = MAX_TOTAL_LEN,
) -> list[Conversation]:
    """Conversations of >= 2 exchanges, cut at max_turns or where the context would pass max_context tokens."""
    candidates = [c for c in conversations if len(c) >= 2]
    random.Random(seed).shuffle(candidates)
    picked: list[Conversation] = []
    for exchanges in candidates:
        if len(picked) == num:
            break
        turns = _turns_within(exchanges[:max_turns], tokenizer, max_context)
        if len(turns) >= 2:
            picked.append(Conversation(tuple(turns)))
    if len(picked) < num:
        raise ValueError(f"the ShareGPT file has {len(picked)} usable multi-turn conversations; asked for {num}")
    return picked


def _turns_within(exchanges: list[Exchange], tokenizer: CountingTokenizer | None, max_context: int) -> list[Turn]:
    turns: list[Turn] = []
    context = 0
    for ex in exchanges:
        if tokenizer is None:  # lengths unknown: chars / 4 is a rough budget; max_tokens needs a number
            prompt_len, out_len, budget = 0, max(MIN_LEN, len(ex.gpt) // 4), len(ex.human) // 4
        else:
            prompt_len = len(tokenizer.encode(ex.human, add_special_tokens=False))
            out_len = len(tokenizer.encode(ex.gpt, add_special_tokens=False))
            budget = prompt_len
        if (prompt_len and prompt_len < MIN_LEN) or out_len < MIN_LEN:
            break
        context += budget + out_len
        if context > max_context:
            break
        turns.append(Turn(ex.human, prompt_len, out_len))
    return turns
