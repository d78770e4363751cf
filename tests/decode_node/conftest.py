"""A small real tokenizer (one token per character) for scheduler and output tests: no model needed."""

from __future__ import annotations

import string

import pytest
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import decoders, models, pre_tokenizers

from pdserve.engine.tokenizer import SpecialTokens, Tokenizer

CHARS = string.ascii_lowercase + " .!"  # token id = index; "</s>" (EOS) is len(CHARS)


@pytest.fixture(scope="session")
def char_tokenizer() -> Tokenizer:
    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab["</s>"] = len(CHARS)
    backend = FastTokenizer(models.WordLevel(vocab, unk_token="</s>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["</s>"])
    return Tokenizer(backend, special_tokens=SpecialTokens(eos_token="</s>"))
