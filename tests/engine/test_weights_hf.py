"""Hugging Face model directories written by transformers itself load back unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pdserve.engine.config import Llama3RopeScaling
from pdserve.engine.weights import ModelSpec, load_model
from pdserve.engine.weights.hf_config import hf_config, write_hf_config

_SHAPE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128}
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _save(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(str(path))
    return model.state_dict()


@pytest.mark.parametrize("kind", ["qwen2", "llama3-rope", "llama-tied"])
def test_hf_directory_round_trip(tmp_path: Path, kind: str) -> None:
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**_SHAPE, tie_word_embeddings=False))
    else:
        extra = {"rope_parameters": _LLAMA3} if kind == "llama3-rope" else {"tie_word_embeddings": True}
        model = LlamaForCausalLM(LlamaConfig(**_SHAPE, eos_token_id=[3, 4], bos_token_id=2, **extra))
    reference = _save(model, tmp_path)
    loaded = load_model(ModelSpec(str(tmp_path), load_format="hf"), dtype=torch.float32)
    assert set(loaded.weights) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(loaded.weights[name], tensor), name
    config = loaded.config
    assert config.attention_bias == (kind == "qwen2")
    assert config.tie_word_embeddings == (kind == "llama-tied")
    assert config.max_model_len == 128 and loaded.tokenizer is None
    if kind == "llama3-rope":
        assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 32) and config.rope_theta == 500000.0
        assert config.eos_token_ids == (3, 4) and config.bos_token_id == 2


def test_written_config_reads_back_in_transformers_and_here(tmp_path: Path) -> None:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**_SHAPE, rope_parameters=_LLAMA3)).save_pretrained(str(tmp_path / "src"))
    config = hf_config(tmp_path / "src", "tiny")
    out = tmp_path / "out"
    out.mkdir()
    write_hf_config(config, out, "llama")
    assert hf_config(out, "tiny") == config
    hf = AutoConfig.from_pretrained(str(out))
    assert hf.rope_parameters["rope_type"] == "llama3" and hf.rope_parameters["rope_theta"] == 500000.0
    assert (hf.num_key_value_heads, hf.head_dim) == (2, 16)


def test_wrong_shapes_are_named(tmp_path: Path) -> None:
    LlamaForCausalLM(LlamaConfig(**_SHAPE)).save_pretrained(str(tmp_path))
    config_file = tmp_path / "config.json"
    config_file.write_text(config_file.read_text().replace('"intermediate_size": 80', '"intermediate_size": 81'))
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight has shape \(80, 64\), the config implies \(81, 64\)"):
        load_model(ModelSpec(str(tmp_path), load_format="hf"))
