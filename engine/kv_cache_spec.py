"""What the paged KV pool stores: its dtype and, for an fp8 cache, one K and one V scale per layer.

    --kv-cache-dtype auto ─▶ the model's dtype, no scales (every scale 1.0, unused)
    --kv-cache-dtype fp8  ─▶ float8_e4m3fn; scales from the checkpoint (model.layers.{i}.self_attn.k_scale /
                             v_scale: engine/weights/kv_scales.py), else 1.0 for every layer (vLLM's default)
      + --calculate-kv-scales ─▶ computed once at start from a built-in text, the same on every worker
                                 (engine/kv_scale_calibration.py)

The scales are fixed when the worker starts and never change. A P and its D must quantize alike, so the rule
has to be one each can apply without talking: the checkpoint's numbers, 1.0, or the built-in text's. Calibrating
from the first prefill a worker serves (as vLLM's flag does) would give each worker its own scales, which P would
have to publish to D and the tiers would have to key on, and a cached block would depend on which prompt a
worker saw first. 1.0 keeps |x| <= 448 exact in range, and a Llama-family model's rotated keys and values stay
far below that (SmolLM2-135M: docs/quantization.md); values beyond it saturate. e4m3 keeps 3 mantissa bits
whatever the scale, so a scale moves the range, not the precision, until values fall into the subnormals
(below 2^-6 x scale): what a calibrated scale gains.

`fingerprint` is the KV compatibility key: it replaces the model fingerprint in every block hash, tier key and
P-D target check, so KV of two specs never mixes; an fp8 key also names the fp8 block layout (kernels/fp8.py).
For `auto` it is the model fingerprint itself (which names the model dtype, hence the KV dtype), so bf16 caches
keep their keys.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "fp8")
FP8_LAYOUT = "K:Hkv,page,D;V:Hkv,D,page"  # an fp8 block's halves (kernels/fp8.py): in the key, so no other mixes
_FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class KVCacheSpec:
    dtype: torch.dtype
    k_scales: tuple[float, ...] = ()  # one per layer; empty: 1.0 everywhere (and not an fp8 cache)
    v_scales: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.k_scales) != len(self.v_scales):
            raise ValueError(f"{len(self.k_scales)} K scales but {len(self.v_scales)} V scales")
        bad = [s for s in self.k_scales + self.v_scales if not s > 0 or s == float("inf")]
        if bad:
            raise ValueError(f"KV scales must be positive and finite, got {bad[:4]}")
        if self.k_scales and self.dtype != _FP8:
            raise ValueError(f"KV scales belong to an fp8 cache, not {self.dtype}")

    @classmethod
    def build(cls, kv_cache_dtype: str, model_dtype: torch.dtype, num_layers: int,
              checkpoint_scales: tuple[Sequence[float], Sequence[float]] | None = None) -> KVCacheSpec:
        """`kv_cache_dtype` as the flag gives it; checkpoint_scales: (K, V) per layer (the checkpoint's or
        calculated ones), or None."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}; choose one of {KV_CACHE_DTYPES}")
        if kv_cache_dtype == "auto":
            return cls(model_dtype)
        k, v = checkpoint_scales if checkpoint_scales is not None else ([1.0] * num_layers, [1.0] * num_layers)
        if len(k) != num_layers or len(v) != num_layers:
            raise ValueError(f"{len(k)} K and {len(v)} V scales for {num_layers} layers")
        return cls(_FP8, tuple(_as_float32(s) for s in k), tuple(_as_float32(s) for s in v))

    @property
    def is_fp8(self) -> bool:
        return bool(self.dtype == _FP8)

    def layer_scales(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of one layer, as the kernels take them."""
        if not self.k_scales:
            return 1.0, 1.0
        return self.k_scales[layer], self.v_scales[layer]

    def fingerprint(self, model_fingerprint: str) -> str:
        """The KV compatibility key: the model fingerprint for `auto`, else a digest of it, the dtype and the
        scales' float32 bits (so 1.0 and 1.0000001 differ exactly when the kernels would)."""
        if not self.is_fp8:
            return model_fingerprint
        bits = [struct.pack("<f", s).hex() for s in self.k_scales + self.v_scales]
        payload = json.dumps({"model": model_fingerprint, "kv_dtype": str(self.dtype), "scales": bits,
                              "layout": FP8_LAYOUT})
        return hashlib.sha256(payload.encode()).hexdigest()[:32]


def _as_float32(value: float) -> float:
    """What a float32 scalar holds: the scale the kernels use, and the one the fingerprint names."""
    return float(struct.unpack("<f", struct.pack("<f", float(value)))[0])
