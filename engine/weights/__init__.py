"""Model loading: GGUF files, Hugging Face directories, embedded (pip-fetched) models and dummy presets.

The names below torch-free modules hold are imported with the package; LoadedModel, load_model, parse_dtype and
resolve_device (loader.py, which imports torch) only when first asked for, so that the router and the launcher,
which read a model's tokenizer and limits through this package, import no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pdserve.engine.weights.fetch import default_cache_dir, fetch_default_model
from pdserve.engine.weights.locate import ModelSpec, load_tokenizer
from pdserve.engine.weights.registry import DEFAULT_MODEL, KNOWN_MODELS, ResolvedModel, resolve_model

if TYPE_CHECKING:
    from pdserve.engine.weights.loader import LoadedModel, load_model, parse_dtype, resolve_device

_FROM_LOADER = ("LoadedModel", "load_model", "parse_dtype", "resolve_device")

__all__ = [
    "DEFAULT_MODEL", "KNOWN_MODELS", "LoadedModel", "ModelSpec", "ResolvedModel", "default_cache_dir",
    "fetch_default_model", "load_model", "load_tokenizer", "parse_dtype", "resolve_device", "resolve_model",
]


def __getattr__(name: str) -> Any:
    if name in _FROM_LOADER:
        return getattr(importlib.import_module("pdserve.engine.weights.loader"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
