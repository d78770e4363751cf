"""Preset shapes: parameter counts from shapes alone (nothing allocated), and the weight layout."""

from __future__ import annotations

import pytest

from pdserve.engine.presets import PRESETS, get_preset, param_count, weight_shapes


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama3-8b", 8_030_261_248),  # Meta's model card: 8.03 B
        ("llama3-70b", 70_553_706_496),  # 70.6 B
        ("qwen2.5-7b", 7_615_616_512),  # Qwen's model card: 7.61 B
        ("smollm2-135m", 134_515_008),  # tied head counted once
    ],
)
def test_param_counts_match_the_published_models(name: str, expected: int) -> None:
    assert param_count(get_preset(name)) == expected


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="llama3-8b") as err:
        get_preset("llama9-1t")
    assert "llama9-1t" in str(err.value)


def test_qwen_has_qkv_biases_and_llama3_has_rope_scaling() -> None:
    qwen = weight_shapes(PRESETS["qwen2.5-7b"])
    assert qwen["model.layers.27.self_attn.k_proj.bias"] == (512,)
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen
    assert not any(name.endswith(".bias") for name in weight_shapes(PRESETS["llama3-8b"]))
    scaling = PRESETS["llama3-8b"].rope_scaling
    assert scaling is not None and scaling.factor == 8.0 and scaling.original_max_position_embeddings == 8192


def test_weight_names_follow_hf_naming() -> None:
    shapes = weight_shapes(PRESETS["smollm2-135m"])
    assert len(shapes) == 2 + 30 * 9 + 1  # embed, head, 9 per layer, final norm
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (576, 576)
    assert shapes["model.layers.29.mlp.down_proj.weight"] == (576, 1536)
    assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"] == (49152, 576)
