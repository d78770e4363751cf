"""Hugging Face config files ↔ ModelConfig, torch-free (the router reads a model's limits and tokenizer without
importing torch): config.json and generation_config.json, and what quantization_config says.

Reads both config styles: transformers 4 (`rope_theta`, `rope_scaling`) and transformers 5
(`rope_parameters: {rope_type, rope_theta, ...}`). Writes the transformers 4 style, which both read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.engine.config import Llama3RopeScaling, ModelConfig

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _rope(raw: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    params = raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (only 'llama3'): {scaling}")
    return theta, Llama3RopeScaling(
        factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def hf_quantization(path: Path) -> str | None:
    """"fp8" for an FP8 checkpoint, None for an unquantized one (engine/weights/fp8_checkpoint.py)."""
    return checkpoint_quantization(_read_json(path / "config.json"), str(path / "config.json"))


def hf_config(path: Path, name: str) -> ModelConfig:
    raw = _read_json(path / "config.json")
    model_type = raw.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"{path / 'config.json'}: model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(_ARCHITECTURES)})")
    theta, scaling = _rope(raw)
    heads = int(raw["num_attention_heads"])
    generation = _read_json(path / "generation_config.json")
    eos = _ids(generation.get("eos_token_id", raw.get("eos_token_id")))
    return ModelConfig(
        name=name, vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]), num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads", heads)),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        max_model_len=int(raw["max_position_embeddings"]), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling,
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def write_hf_config(config: ModelConfig, path: Path, model_type: str) -> None:
    """config.json + generation_config.json that transformers can load."""
    raw: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_model_len,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta, "hidden_act": "silu",
        "attention_bias": config.attention_bias, "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids),
        "torch_dtype": "float32",
    }
    if config.rope_scaling is not None:
        s = config.rope_scaling
        raw["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                               "high_freq_factor": s.high_freq_factor,
                               "original_max_position_embeddings": s.original_max_position_embeddings}
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def checkpoint_quantization(raw_config: dict[str, Any], source: str) -> str | None:
    """"fp8" for a checkpoint stored in one of the formats above, None for an unquantized one; any other
    quantization is refused, naming it."""
    q = raw_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        return "fp8"
    if method == "compressed-tensors":
        for name, group in (q.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            if (w.get("type"), w.get("num_bits"), w.get("strategy")) not in (("float", 8, "tensor"),
                                                                             ("float", 8, "channel")):
                raise ValueError(f"{source}: compressed-tensors group {name!r} stores weights as {w}; only 8-bit "
                                 f"float per tensor or per channel loads")
        return "fp8"
    raise ValueError(f"{source}: quantization_config quant_method {method!r} is not supported (fp8 and "
                     f"compressed-tensors fp8 are)")
