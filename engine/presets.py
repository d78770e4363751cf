"""Model shapes by name (for `--load-format dummy --model-preset ...`) and the weight layout they imply.

Every loader (GGUF, HF directory, dummy) produces the same HF-named weight dict; `weight_shapes` is the
single description of it, so loaders validate against it and `param_count` never allocates anything.
"""

from __future__ import annotations

import math

from pdserve.engine.config import Llama3RopeScaling, ModelConfig

_LLAMA31_SCALING = Llama3RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA3_EOS = (128001, 128008, 128009)  # <|end_of_text|>, <|eom_id|>, <|eot_id|>

PRESETS: dict[str, ModelConfig] = {
    # meta-llama/Llama-3.1-8B-Instruct
    "llama3-8b": ModelConfig(
        name="llama3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, max_model_len=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING, bos_token_id=128000, eos_token_ids=_LLAMA3_EOS,
    ),
    # meta-llama/Llama-3.1-70B-Instruct
    "llama3-70b": ModelConfig(
        name="llama3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, max_model_len=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING, bos_token_id=128000, eos_token_ids=_LLAMA3_EOS,
    ),
    # Qwen/Qwen2.5-7B-Instruct: q/k/v biases, untied 152064-row head
    "qwen2.5-7b": ModelConfig(
        name="qwen2.5-7b", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, max_model_len=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, attention_bias=True, eos_token_ids=(151645, 151643),
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct: tied embeddings
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, max_model_len=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    ),
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def layer_weight_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """HF names and [out, in] shapes of one decoder layer."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    p = f"model.layers.{layer}."
    shapes: dict[str, tuple[int, ...]] = {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
    }
    if config.attention_bias:
        shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of the model in HF naming; `lm_head.weight` is listed even when tied to the embedding."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    for layer in range(config.num_layers):
        shapes.update(layer_weight_shapes(config, layer))
    shapes["model.norm.weight"] = (config.hidden_size,)
    shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


def param_count(config: ModelConfig) -> int:
    """Number of distinct parameters (a tied head counts once), computed from shapes alone."""
    total = sum(math.prod(shape) for shape in weight_shapes(config).values())
    if config.tie_word_embeddings:
        total -= config.vocab_size * config.hidden_size
    return total
