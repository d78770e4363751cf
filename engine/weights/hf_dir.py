"""Hugging Face model directories' weights: *.safetensors → HF-named tensors (config.json is hf_config.py's)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.config import ModelConfig
from pdserve.engine.presets import weight_shapes
from pdserve.engine.weights.fp8_checkpoint import is_fp8, is_scale


def safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def load_safetensors(path: Path, config: ModelConfig, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """Load every expected weight, cast one tensor at a time (peak memory: one fp32 tensor over the result).
    An FP8 checkpoint's fp8 weights stay fp8 and their scales fp32 (engine/weights/fp8_checkpoint.py)."""
    shapes = weight_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if name in shapes:  # drops e.g. old checkpoints' rotary_emb.inv_freq buffers
                    tensor = f.get_tensor(name)
                    weights[name] = tensor.to(device=device, dtype=tensor.dtype if is_fp8(tensor) else dtype)
                elif is_scale(name) and name.rsplit(".", 1)[0] + ".weight" in shapes:
                    weights[name] = f.get_tensor(name).to(device=device, dtype=torch.float32)
    if config.tie_word_embeddings and "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    check_weights(weights, config, str(path))
    return weights


def check_weights(weights: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    shapes = weight_shapes(config)
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise ValueError(f"{source}: {len(missing)} weights missing, e.g. {missing[:3]}")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{source}: {name} has shape {tuple(weights[name].shape)}, the config implies {shape}")
