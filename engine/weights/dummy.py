"""Random weights with the real shapes, for benchmarks (`--load-format dummy --model-preset llama3-8b`).

Each tensor is allocated directly on the target device in the target dtype and filled in place there, so
a 16 GB fp16 llama3-8b never passes through host memory or fp32. device="meta" allocates nothing (shapes
only).
"""

from __future__ import annotations

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.presets import weight_shapes

_STD = 0.02  # HF's initializer_range: keeps activations finite in fp16 through 80 layers


def dummy_weights(config: ModelConfig, dtype: torch.dtype, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = None if device == "meta" else torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(config).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            weights[name] = weights["model.embed_tokens.weight"]
            continue
        tensor = torch.empty(shape, dtype=dtype, device=device)
        if generator is not None:
            _fill(name, tensor, generator)
        weights[name] = tensor
    return weights


def _fill(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    if name.endswith("norm.weight"):
        tensor.fill_(1.0)
    elif name.endswith(".bias"):
        tensor.zero_()
    else:
        tensor.normal_(0.0, _STD, generator=generator)
