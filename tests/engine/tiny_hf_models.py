"""Tiny random Hugging Face models (Llama, Qwen2 with q/k/v biases, Llama 3 rope scaling) for parity tests.

Each is saved with save_pretrained and read back through engine.weights.hf_dir, so the ModelConfig is the
one the engine would build from a real checkpoint directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from pdserve.engine.config import ModelConfig
from pdserve.engine.weights.hf_config import hf_config

_SHAPE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128}
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

KINDS = ("llama", "qwen2", "llama3-rope", "tied")


@dataclass(frozen=True)
class TinyModel:
    hf: PreTrainedModel
    config: ModelConfig
    weights: dict[str, torch.Tensor]


def make_tiny(kind: str, path: Path, seed: int = 0) -> TinyModel:
    torch.manual_seed(seed)
    if kind == "qwen2":
        model: PreTrainedModel = Qwen2ForCausalLM(Qwen2Config(**_SHAPE, tie_word_embeddings=False))
        with torch.no_grad():  # HF initialises biases to zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "llama3-rope":
        config = LlamaConfig(**_SHAPE, rope_parameters=_LLAMA3_ROPE, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    else:
        model = LlamaForCausalLM(LlamaConfig(**_SHAPE, tie_word_embeddings=kind == "tied"))
    with torch.no_grad():  # non-trivial norms so a misplaced weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.eval()
    model.save_pretrained(path)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return TinyModel(model, hf_config(path, kind), state)


@torch.no_grad()
def hf_last_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([token_ids])).logits[0, -1].float()
