"""Where a model's files are, torch-free: ModelSpec (what to load), model_dir (the HF directory, fetched or
converted on first use) and load_tokenizer (the tokenizer without the weights, for the router). The weights
themselves are loader.py's, which imports torch; a process that only needs a model's tokenizer and limits
(the router, the launcher) imports no torch unless a GGUF source must be converted first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdserve.engine.presets import get_preset
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.weights.convert import ensure_converted
from pdserve.engine.weights.fetch import converted_dir, default_cache_dir, fetch_model
from pdserve.engine.weights.fingerprint import file_digest
from pdserve.engine.weights.hf_config import hf_config
from pdserve.engine.weights.hub import HubOptions, snapshot_dir
from pdserve.engine.weights.registry import DEFAULT_MODEL, ModelKind, ResolvedModel, resolve_model


@dataclass(frozen=True)
class ModelSpec:
    """What to load. `model`: an embedded model name, a .gguf file, an HF directory or repo id, or (dummy) a
    preset; `hub`: where repo ids are found (revision, cache, downloads)."""

    model: str = DEFAULT_MODEL
    load_format: str = "auto"  # "auto" | "gguf" | "hf" | "dummy"
    tokenizer: str | None = None  # directory with tokenizer.json, overriding the model's (or giving dummy one)
    seed: int = 0  # dummy weights
    hub: HubOptions = field(default_factory=HubOptions)
    # "fp8": the layers' linears in fp8 (quantized at fuse_weights, or as an FP8 checkpoint stores them);
    # "none": in the model dtype; None: as the checkpoint is (fp8 for an FP8 checkpoint, else none)
    quantization: str | None = None



def load_tokenizer(spec: ModelSpec | str, cache_dir: Path | str | None = None,
                   progress: bool = True) -> Tokenizer | None:
    """The model's tokenizer without its weights (for the router); fetches/converts like load_model."""
    spec = ModelSpec(spec) if isinstance(spec, str) else spec
    resolved = resolve_model(spec.model, spec.load_format)
    if spec.tokenizer is not None or resolved.kind is ModelKind.DUMMY:
        eos = get_preset(resolved.preset).eos_token_ids if resolved.preset else ()
        return Tokenizer.from_dir(spec.tokenizer, eos_token_ids=eos) if spec.tokenizer is not None else None
    path = model_dir(resolved, Path(cache_dir) if cache_dir is not None else default_cache_dir(), progress, spec.hub)
    if not (path / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_dir(path, hf_config(path, resolved.name).eos_token_ids)


def model_dir(resolved: ResolvedModel, cache: Path, progress: bool = True, hub: HubOptions | None = None) -> Path:
    """The HF directory to load (not for DUMMY), fetching and converting GGUF sources on first use and
    finding (or downloading) repo ids in the hub cache."""
    if resolved.kind is ModelKind.EMBEDDED:
        assert resolved.embedded is not None
        return fetch_model(resolved.embedded, cache, progress)
    if resolved.kind is ModelKind.HUB:
        path = snapshot_dir(resolved.name, hub or HubOptions(), progress)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{resolved.name}: the snapshot {path} has no config.json (a GGUF-only repo? "
                                    f"give the .gguf file's path instead)")
        return path
    assert resolved.path is not None
    if resolved.kind is ModelKind.GGUF:
        return ensure_converted(resolved.path, converted_dir(cache, resolved.name, file_digest(resolved.path)),
                                resolved.name, progress)
    return resolved.path
