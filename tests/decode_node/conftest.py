"""A small real tokenizer (one token per character) for scheduler and output tests: no model needed."""

from __future__ import annotations

import string
from collections.abc import Iterator

import pytest
import torch
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


@pytest.fixture(scope="module")
def offline(loaded_default, model_cache_dir):
    """The offline engine (pdserve.llm.LLM) on the default model: the reference outputs of the engine tests."""
    from pdserve.llm import LLM

    return LLM(num_blocks=64, max_num_seqs=8, cache_dir=model_cache_dir, progress=False)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one CPU thread: with other processes busy on a 2-core machine, the offline reference took
    1.3-19.6 s on two threads (spinning threads contend) and a steady 2.5 s on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
