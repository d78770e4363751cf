"""An fp8 checkpoint's KV cache scales: `model.layers.{i}.self_attn.k_scale` and `.v_scale`, float32 scalars
(the names vLLM and llm-compressor write; engine/kv_cache_spec.py says how they are used). A checkpoint has
them for every layer or none; some layers only is an error, not a silent 1.0."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.kv_cache_spec import KVCacheSpec
from pdserve.engine.weights.hf_dir import safetensors_files
from pdserve.engine.weights.loader import LoadedModel

_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale")


def checkpoint_kv_scales(path: Path | None, num_layers: int) -> tuple[list[float], list[float]] | None:
    """(K scales, V scales) per layer from the safetensors under `path`, or None when it has none."""
    if path is None:
        return None
    found: dict[tuple[str, int], float] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                match = _NAME.fullmatch(name)
                if match is not None:
                    found[(match.group(2), int(match.group(1)))] = float(f.get_tensor(name).float().reshape(-1)[0])
    if not found:
        return None
    wanted = {(kind, i) for kind in "kv" for i in range(num_layers)}
    if set(found) != wanted:
        missing = sorted(wanted - set(found))[:4]
        raise ValueError(f"{path}: KV scales for {len(found)} of {2 * num_layers} layer halves; missing e.g. {missing}")
    return [found[("k", i)] for i in range(num_layers)], [found[("v", i)] for i in range(num_layers)]


def load_kv_cache_spec(kv_cache_dtype: str, dtype: torch.dtype, loaded: LoadedModel,
                       calibrated: tuple[list[float], list[float]] | None = None) -> KVCacheSpec:
    """The pool's spec for `--kv-cache-dtype` (auto | fp8) over a loaded model of weights dtype `dtype`; an fp8
    cache takes `calibrated` scales when given (`--calculate-kv-scales`: engine/kv_scale_calibration.py, which
    win over the checkpoint's, as in vLLM), else the checkpoint's when it has them (read only then)."""
    layers = loaded.config.num_layers
    if calibrated is not None and kv_cache_dtype != "fp8":
        raise ValueError(f"calculated KV scales are for an fp8 cache, not --kv-cache-dtype {kv_cache_dtype}")
    scales = calibrated
    if scales is None and kv_cache_dtype == "fp8":
        scales = checkpoint_kv_scales(loaded.path, layers)
    return KVCacheSpec.build(kv_cache_dtype, dtype, layers, scales)
