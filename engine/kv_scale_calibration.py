"""`--calculate-kv-scales`: an fp8 cache's per-layer K and V scales computed once, as the worker starts, and fixed
from then on (vLLM's flag of that name takes them from the first batch it runs).

A P and its D must quantize alike, and so must every worker whose blocks meet in host RAM or Redis, so the scales
cannot come from whatever prompt a worker happens to see first. Every worker computes them alone from the same
input, the built-in CALIBRATION_TEXT (seeded token ids for a model without a tokenizer):

    the text's tokens ─▶ one prefill over a scratch pool in the model's dtype (the engine's own kernels)
                     ─▶ per layer, the largest |K| (after RoPE) and |V| it wrote
                     ─▶ scale = the power of two that puts that largest value in (112, 224]

224 is half of e4m3's 448: prompts whose values outgrow the text's keep at least 2x of headroom before they
saturate (vLLM divides by 200 for K and 100 for V, for the same reason). A power of two makes `x / scale` and
`code * scale` exact, so the scale only moves e4m3's range (normal values from 2^-6 x scale up), and a last-bit
difference in the largest value between two devices moves a scale only where that value sits on a power of two.
Where it does, the scales differ, so does the KV compatibility key (engine/kv_cache_spec.py), and the P-D
handshake and the tiers refuse to mix the two: never silently.
"""

from __future__ import annotations

import math

import torch

from pdserve.engine.attention_metadata import PrefillChunk, build_prefill_batch
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.kv_cache import allocate_kv_caches
from pdserve.engine.model import LlamaModel, ModelWeights
from pdserve.engine.tokenizer import Tokenizer

E4M3_HEADROOM_MAX = 224.0  # half of e4m3's largest finite value (448)
CALIBRATION_SEED = 0  # the token ids of a model without a tokenizer
BLOCK_SIZE = 16  # the scratch pool's; the values written do not depend on it

CALIBRATION_TEXT = """\
The lighthouse keeper wrote in the log every evening: wind from the north-west at 14 knots, visibility 6 miles,
two fishing boats in before dark. On 3 March 1911 the entry is longer. "The lamp failed at 21:40. I relit it by
hand and kept watch until the relief came at 04:15." Nobody knows why the mechanism stopped that night.

User: Can you explain what a hash table is, in two sentences?
Assistant: A hash table stores key-value pairs in an array, using a hash function to turn each key into the index
where its value lives. Lookups, inserts and deletes take constant time on average, as long as collisions stay rare.

def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

| city      | population (2020) | area (km²) |
|-----------|-------------------|------------|
| Lisbon    | 545,923           | 100.05     |
| Helsinki  | 656,920           | 715.48     |

Die Katze schläft auf dem Fensterbrett, während draußen der Regen fällt. 東京は日本の首都です。
La réunion commence à neuf heures ; apportez vos notes, s'il vous plaît.

To solve 3x + 7 = 22, subtract 7 from both sides to get 3x = 15, then divide by 3: x = 5. Check: 3 * 5 + 7 = 22.
SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id) GROUP BY name ORDER BY orders DESC;
{"id": 42, "tags": ["alpha", "beta"], "active": true, "score": 0.875}

In the end, the committee agreed on three points: the bridge would be repaired before winter, the budget would
be published every quarter, and anyone could attend the meetings. The minutes were signed and sent the next day.
"""


def calibration_tokens(tokenizer: Tokenizer | None, config: ModelConfig) -> list[int]:
    """CALIBRATION_TEXT's tokens (without special tokens), or as many seeded ids without a tokenizer; at most
    max_model_len."""
    if tokenizer is not None:
        ids = tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)
    else:
        generator = torch.Generator().manual_seed(CALIBRATION_SEED)
        ids = torch.randint(0, config.vocab_size, (len(CALIBRATION_TEXT) // 4,), generator=generator).tolist()
    return ids[:config.max_model_len]


def power_of_two_scale(amax: float) -> float:
    """The power of two s with amax / s in (112, 224]; 1.0 for a layer that wrote only zeros."""
    if not math.isfinite(amax) or amax < 0:
        raise ValueError(f"cannot calibrate an fp8 KV scale from a largest |value| of {amax}")
    if amax == 0:
        return 1.0
    mantissa, exponent = math.frexp(amax / E4M3_HEADROOM_MAX)  # amax / 224 = mantissa * 2^exponent, mantissa in [0.5, 1)
    return math.ldexp(1.0, exponent - 1 if mantissa == 0.5 else exponent)


def calibrate_kv_scales(config: ModelConfig, weights: ModelWeights,
                        tokens: list[int]) -> tuple[list[float], list[float]]:
    """(K scales, V scales) per layer from one prefill of `tokens` over a scratch pool in the weights' dtype,
    on the weights' device."""
    if not tokens:
        raise ValueError("no calibration tokens")
    blocks = -(-len(tokens) // BLOCK_SIZE)
    caches = allocate_kv_caches(config, CacheConfig(num_blocks=blocks, block_size=BLOCK_SIZE),
                                weights.embed.device, weights.embed.dtype)
    batch = build_prefill_batch([PrefillChunk(tokens, 0, list(range(blocks)))], BLOCK_SIZE, weights.embed.device)
    with torch.inference_mode():
        LlamaModel(config, weights).forward_prefill(batch, caches)
        amax = torch.stack([kv.abs().amax(dim=(1, 2, 3, 4)) for kv in caches]).float().cpu()  # [layers, K|V]
    return ([power_of_two_scale(a) for a in amax[:, 0].tolist()],
            [power_of_two_scale(a) for a in amax[:, 1].tolist()])


def calibrated_kv_scales(config: ModelConfig, weights: ModelWeights,
                         tokenizer: Tokenizer | None) -> tuple[list[float], list[float]]:
    """What `--calculate-kv-scales` gives a worker of this model: the same on every worker (see above)."""
    return calibrate_kv_scales(config, weights, calibration_tokens(tokenizer, config))
