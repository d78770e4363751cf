"""The tokenizer `pdserve bench` counts with: what it needs is encode/decode and a vocabulary size."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class CountingTokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


def load_tokenizer(path: str | Path) -> CountingTokenizer:
    """A Hugging Face tokenizer directory (tokenizer.json + config files) through engine/tokenizer.py."""
    from pdserve.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(path)


def count_tokens(tokenizer: CountingTokenizer, texts: list[str]) -> list[int]:
    """Token counts without special tokens (what a prompt adds to the context, as vLLM's ShareGPT filter counts)."""
    return [len(tokenizer.encode(text, add_special_tokens=False)) for text in texts]
