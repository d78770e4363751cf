"""pdserve against Hugging Face transformers on the default model (SmolLM2-135M-Instruct GGUF, fp32, CPU):
last-position logits of a packed batch, and 32 greedy tokens through the offline LLM (batched, chunked),
each checked against transformers' argmax given the tokens before it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.weights import LoadedModel
from pdserve.llm import LLM

RAW = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "import numpy as np\nx = np.arange(10)\n",
    "Water boils at a temperature of",
    "Translate to French: 'Good morning, how are you?'",
    "The most important thing about writing tests is",
]
CHAT = ["What is 2 + 2?", "Write a haiku about the ocean.", "Name three planets of the solar system."]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompt_ids(default_tokenizer: Tokenizer) -> list[list[int]]:
    chat = [default_tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
    return ([default_tokenizer.encode(p) for p in RAW]
            + [default_tokenizer.encode(c, add_special_tokens=False) for c in chat])


def test_last_position_logits_match_hf(loaded_default: LoadedModel, hf_model: torch.nn.Module,
                                       prompt_ids: list[list[int]]) -> None:
    runner = ModelRunner(loaded_default.config, CacheConfig(num_blocks=128), loaded_default.weights, "cpu",
                         torch.float32, max_num_seqs=16)
    chunks, next_block = [], 0
    for ids in prompt_ids:
        n = -(-len(ids) // 16)
        chunks.append(PrefillChunk(ids, 0, list(range(next_block, next_block + n))))
        next_block += n
    logits = runner.prefill(chunks).logits
    with torch.no_grad():
        for row, ids in enumerate(prompt_ids):
            expected = hf_model(torch.tensor([ids])).logits[0, -1]
            assert (logits[row] - expected).abs().max() < 1e-3


def hf_argmax_along(hf_model: torch.nn.Module, ids: list[int], generated: list[int]) -> list[int]:
    """transformers' greedy choice after the prompt and after each prefix of `generated`, from one forward over
    prompt + generated (teacher forcing): `generated` is HF's own greedy continuation exactly when the two lists
    are equal. One forward a prompt instead of HF's 32 incremental steps (~35 CPU-s of the suite's 2 cores)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + generated])).logits[0, len(ids) - 1:]
    return logits.argmax(dim=-1).tolist()[:len(generated)]


def test_greedy_tokens_match_hf(model_cache_dir: Path, prompt_ids: list[list[int]],
                                hf_model: torch.nn.Module) -> None:
    """All 11 prompts in one batch, 24-token prefill chunks (so long prompts take two steps); every token is
    transformers' greedy choice given the tokens before it, and a sequence ends where HF's would: at EOS, or
    after NEW_TOKENS."""
    llm = LLM(num_blocks=256, max_num_seqs=16, chunk_size=24, cache_dir=model_cache_dir, progress=False)
    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    for i, (out, ids) in enumerate(zip(outs, prompt_ids, strict=True)):
        assert out.token_ids == hf_argmax_along(hf_model, ids, out.token_ids), f"prompt {i}"
        eos_at = [j for j, token in enumerate(out.token_ids) if token in llm.eos_token_ids]
        if out.finish_reason == "stop":
            assert eos_at == [len(out.token_ids) - 1], f"prompt {i}"
        else:
            assert out.finish_reason == "length" and not eos_at and len(out.token_ids) == NEW_TOKENS, f"prompt {i}"
    assert sum(o.finish_reason == "stop" for o in outs[len(RAW):]) >= 1  # chat answers end with EOS
    assert llm.pool.num_used == 0
