"""`--calculate-kv-scales` (engine/kv_scale_calibration.py): the power-of-two rule, the scales a model's built-in
text gives (the same on every build, overriding a checkpoint's, keyed into the compatibility key), what they do
to the pool's codes, and the refusals without an fp8 cache. The served path: tests/e2e/test_fp8_kv_serve.py."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from test_kv_cache_spec import _with_scales
from tiny_hf_models import make_tiny

from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.kv_cache_spec import KVCacheSpec
from pdserve.engine.kv_scale_calibration import (
    calibrate_kv_scales,
    calibrated_kv_scales,
    calibration_tokens,
    power_of_two_scale,
)
from pdserve.engine.model import fuse_weights
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights import load_model
from pdserve.engine.weights.kv_scales import load_kv_cache_spec
from pdserve.settings import ModelSettings

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize(("amax", "scale"), [
    (224.0, 1.0), (224.01, 2.0), (112.0, 0.5), (112.5, 1.0), (28.0, 0.125), (26.26, 0.125), (448.0, 2.0),
    (0.75, 2.0**-8), (0.0, 1.0),
])
def test_power_of_two_scale_puts_the_largest_value_in_the_upper_half_of_e4m3s_headroom(amax: float,
                                                                                       scale: float) -> None:
    assert power_of_two_scale(amax) == scale


def test_power_of_two_scale_over_many_magnitudes() -> None:
    for amax in torch.logspace(-6, 6, 997, dtype=torch.float64).tolist():
        scale = power_of_two_scale(amax)
        assert 112 < amax / scale <= 224 and math.frexp(scale)[0] == 0.5, amax  # a power of two


@pytest.mark.parametrize("amax", [float("nan"), float("inf"), -1.0])
def test_a_broken_calibration_says_so(amax: float) -> None:
    with pytest.raises(ValueError, match="cannot calibrate an fp8 KV scale"):
        power_of_two_scale(amax)


def _tiny(tmp_path: Path):
    tiny = make_tiny("llama", tmp_path / "m")
    return tiny, fuse_weights(tiny.config, tiny.weights, torch.device("cpu"), torch.float32, "none")


def test_calculated_scales_put_the_texts_codes_in_112_to_224_in_every_layer(tmp_path: Path) -> None:
    """A runner over an fp8 pool with the calculated scales, prefilling the calibration tokens: each layer's largest
    K and V code is in [112, 224] (e4m3 rounds 112.x down to 112), so the scales are applied as calculated, per
    layer and per half; with scale 1.0 the same codes are the values themselves (< 1 in this tiny model)."""
    tiny, weights = _tiny(tmp_path)
    tokens = calibration_tokens(None, tiny.config)
    k, v = calibrate_kv_scales(tiny.config, weights, tokens)
    assert len(k) == len(v) == tiny.config.num_layers
    table = list(range(-(-len(tokens) // 16)))
    for scales, low, high in ((None, 0.0, 1.0), ((k, v), 112.0, 224.0)):
        spec = KVCacheSpec.build("fp8", torch.float32, tiny.config.num_layers, scales)
        runner = ModelRunner(tiny.config, CacheConfig(num_blocks=len(table)), weights, "cpu", torch.float32,
                             max_num_seqs=1, kv_spec=spec)
        runner.prefill([PrefillChunk(tokens, 0, table)])
        for kv in runner.kv_caches:
            assert kv.dtype == FP8
            for half in (0, 1):
                assert low <= kv[half].float().abs().max().item() <= high


def test_calculated_scales_are_the_same_on_every_build_and_win_over_the_checkpoints(tmp_path: Path) -> None:
    """Two loads of one model (as a P and a D would) calculate the same scales and so the same KV key; it is
    another key than scale 1.0's or the checkpoint's, whose scales the calculated ones replace (as in vLLM)."""
    tiny, weights = _tiny(tmp_path)
    _with_scales(tmp_path / "m", 3, [0.5, 1.0, 2.0], [0.25, 1.0, 4.0])
    specs = []
    for _ in range(2):
        loaded = load_model(str(tmp_path / "m"), dtype=torch.float32)
        fused = fuse_weights(loaded.config, loaded.weights, torch.device("cpu"), torch.float32, "none")
        calibrated = calibrated_kv_scales(loaded.config, fused, loaded.tokenizer)
        specs.append(load_kv_cache_spec("fp8", torch.float32, loaded, calibrated))
    assert specs[0] == specs[1] and specs[0].fingerprint("m") == specs[1].fingerprint("m")
    checkpoint = load_kv_cache_spec("fp8", torch.float32, loaded)
    assert checkpoint.k_scales == (0.5, 1.0, 2.0) and specs[0].k_scales != checkpoint.k_scales
    keys = {specs[0].fingerprint("m"), checkpoint.fingerprint("m"), KVCacheSpec.build("fp8", torch.float32, 3)
            .fingerprint("m")}
    assert len(keys) == 3
    assert specs[0].k_scales == tuple(calibrate_kv_scales(tiny.config, weights, calibration_tokens(None,
                                                                                                    tiny.config))[0])


def test_calibration_tokens_are_the_texts_or_seeded_ids_within_the_context(tmp_path: Path) -> None:
    tiny, _ = _tiny(tmp_path)
    seeded = calibration_tokens(None, tiny.config)
    assert seeded == calibration_tokens(None, tiny.config) and len(set(seeded)) > 50
    assert all(0 <= t < tiny.config.vocab_size for t in seeded)
    assert len(seeded) == tiny.config.max_model_len == 128  # the text would be ~600
    assert len(calibration_tokens(None, dataclasses.replace(tiny.config, max_model_len=40))) == 40


def test_calculated_scales_need_an_fp8_cache(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--calculate-kv-scales needs --kv-cache-dtype fp8, not 'auto'"):
        ModelSettings(calculate_kv_scales=True)
    assert ModelSettings(kv_cache_dtype="fp8", calculate_kv_scales=True).calculate_kv_scales
    make_tiny("llama", tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"), dtype=torch.float32)
    with pytest.raises(ValueError, match="calculated KV scales are for an fp8 cache, not --kv-cache-dtype auto"):
        load_kv_cache_spec("auto", torch.float32, loaded, ([1.0] * 3, [1.0] * 3))
