"""Benchmark workloads: every request is a turn of a `Conversation` (single-turn datasets have one turn each).

random   prompts of random tokens, lengths uniform in [L·(1-r), L·(1+r)] (r = --random-range-ratio, as vLLM)
         or normal with mean L and standard deviation r·L; an optional shared prefix of --prefix-len tokens
prefix   --num-prefix-groups groups; every prompt is its group's shared prefix (--prefix-len tokens) followed by
         a random suffix of --random-input-len tokens: the workload for prefix caching
sharegpt / multiturn  see sharegpt.py

Without a tokenizer, random prompts are sent as token ids (only /v1/completions accepts those) and the
lengths are exact by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.bench.tokenizer import CountingTokenizer

DEFAULT_VOCAB_SIZE = 32_000  # token ids drawn when no tokenizer is given (any Llama-family vocabulary has them)
_FIRST_ID = 256  # skip the low ids: byte fallbacks and special tokens live there in most vocabularies


@dataclass(frozen=True)
class Turn:
    """One request: the new user text (or token ids), its length in tokens, and how many tokens to ask for."""

    prompt: str | list[int]
    prompt_len: int  # tokens in `prompt` alone; 0 when unknown (the server's usage numbers are used)
    output_len: int

    def __post_init__(self) -> None:
        if self.output_len <= 0:
            raise ValueError(f"output_len must be positive, got {self.output_len}")


@dataclass(frozen=True)
class Conversation:
    """Turns sent one after another; turn k's request carries turns 0..k-1 and their answers as history."""

    turns: tuple[Turn, ...]

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError("a conversation needs at least one turn")


@dataclass(frozen=True)
class LengthSpec:
    """How random lengths are drawn: uniform in [mean·(1-ratio), mean·(1+ratio)] or normal(mean, ratio·mean)."""

    mean: int
    range_ratio: float = 0.0
    distribution: str = "uniform"

    def __post_init__(self) -> None:
        if self.mean <= 0:
            raise ValueError(f"length mean must be positive, got {self.mean}")
        if not 0.0 <= self.range_ratio < 1.0 and self.distribution == "uniform":
            raise ValueError(f"--random-range-ratio must be in [0, 1) for uniform lengths, got {self.range_ratio}")
        if self.distribution not in ("uniform", "normal"):
            raise ValueError(f"unknown length distribution {self.distribution!r}; choose uniform or normal")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.distribution == "normal":
            lens = np.rint(rng.normal(self.mean, self.range_ratio * self.mean, n))
        else:
            low = int(np.floor(self.mean * (1 - self.range_ratio)))
            high = int(np.ceil(self.mean * (1 + self.range_ratio)))
            lens = rng.integers(low, high + 1, n)
        clipped: np.ndarray = np.maximum(lens, 1).astype(np.int64)
        return clipped


class PromptMaker:
    """Random-token prompts of an exact token length, as text (with a tokenizer) or as token ids (without)."""

    def __init__(self, tokenizer: CountingTokenizer | None, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.vocab_size = tokenizer.vocab_size if tokenizer is not None else DEFAULT_VOCAB_SIZE

    def random_ids(self, n: int) -> list[int]:
        # vLLM's RandomDataset draws an offset and walks the vocabulary: (offset + i + arange) % vocab
        offset = int(self.rng.integers(0, self.vocab_size))
        span = self.vocab_size - _FIRST_ID
        ids: list[int] = (_FIRST_ID + (offset + np.arange(n)) % span).tolist()
        return ids

    def make(self, ids: list[int]) -> tuple[str | list[int], int]:
        """The prompt for these ids and its token count (text re-encodes to exactly len(ids) tokens)."""
        if self.tokenizer is None:
            return ids, len(ids)
        return self.text_of_length(ids, len(ids)), len(ids)

    def text_of_length(self, ids: list[int], target: int) -> str:
        """Decode, re-encode, and trim or pad until the text is `target` tokens (decode∘encode is not identity)."""
        assert self.tokenizer is not None
        text = self.tokenizer.decode(ids)
        for _ in range(8):
            got = self.tokenizer.encode(text, add_special_tokens=False)
            if len(got) == target:
                return text
            if len(got) > target:
                text = self.tokenizer.decode(got[:target])
            else:
                text = text + self.tokenizer.decode(self.random_ids(target - len(got)))
        return text  # within a token or two of the target after 8 rounds; prompt_len is recounted by the caller


def sample_random(
    num: int,
    input_len: LengthSpec,
    output_len: LengthSpec,
    tokenizer: CountingTokenizer | None,
    seed: int,
    prefix_len: int = 0,
    num_prefix_groups: int = 1,
) -> list[Conversation]:
    """Single-turn random prompts; with prefix_len > 0 each starts with one of num_prefix_groups shared prefixes."""
    if num_prefix_groups <= 0:
        raise ValueError(f"--num-prefix-groups must be positive, got {num_prefix_groups}")
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    prefixes = [maker.random_ids(prefix_len) for _ in range(num_prefix_groups)] if prefix_len > 0 else [[]]
    in_lens, out_lens = input_len.sample(rng, num), output_len.sample(rng, num)
    groups = rng.permutation(np.arange(num) % len(prefixes))
    conversations = []
    for i in range(num):
        prompt, n = maker.make(prefixes[groups[i]] + maker.random_ids(int(in_lens[i])))
        if tokenizer is not None and isinstance(prompt, str):
            n = len(tokenizer.encode(prompt, add_special_tokens=False))
        conversations.append(Conversation((Turn(prompt, n, int(out_lens[i])),)))
    return conversations


def sample_random_multiturn(
    num: int,
    num_turns: int,
    input_len: LengthSpec,
    output_len: LengthSpec,
    tokenizer: CountingTokenizer | None,
    seed: int,
) -> list[Conversation]:
    """Synthetic conversations of num_turns random-token user turns each."""
    if num_turns <= 0:
        raise ValueError(f"--multiturn-turns must be positive, got {num_turns}")
    flat = sample_random(num * num_turns, input_len, output_len, tokenizer, seed)
    return [
        Conversation(tuple(c.turns[0] for c in flat[i * num_turns:(i + 1) * num_turns])) for i in range(num)
    ]
