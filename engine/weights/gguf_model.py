"""GGUF (llama.cpp) → ModelConfig + fp32 weights in Hugging Face naming.

Two things differ from a Hugging Face checkpoint besides the names:
- llama.cpp's converter permutes the rows of attn_q / attn_k of `llama` models, per head, from HF's
  rotate-half layout [x0 .. x(d/2-1) | x(d/2) .. x(d-1)] to interleaved pairs (x0, x(d/2)), (x1, ...).
  `_unpermute` reverses it (same as transformers' LlamaTensorProcessor). qwen2 is not permuted.
- Llama 3.1 rope scaling is stored as a `rope_freqs` tensor (per-frequency divisors), not as metadata;
  `_llama3_scaling` recovers the Llama3RopeScaling parameters that produce it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import SupportsFloat, SupportsInt

import numpy as np
import torch
from gguf.quants import dequantize

from pdserve.engine.config import Llama3RopeScaling, ModelConfig
from pdserve.engine.weights.gguf_file import GGUFFile, read_gguf
from pdserve.kernels.rope import rope_inv_freq

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_NOT_WEIGHTS = {"rope_freqs.weight"}


def field(reader: GGUFFile, key: str, default: object = None) -> object:
    return reader.fields.get(key, default)


def _as_int(value: object, key: str) -> int:
    if isinstance(value, SupportsInt):
        return int(value)
    raise ValueError(f"GGUF metadata {key} is {value!r}, not a number")


def _as_float(value: object, key: str) -> float:
    if isinstance(value, SupportsFloat):
        return float(value)
    raise ValueError(f"GGUF metadata {key} is {value!r}, not a number")


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    blk, layer, module, kind = gguf_name.split(".")
    if blk != "blk" or module not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a Llama-family model")
    return f"model.layers.{layer}.{_LAYER_NAMES[module]}.{kind}"


def gguf_config(reader: GGUFFile, name: str) -> ModelConfig:
    arch = str(field(reader, "general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})")
    tensors = {t.name: t for t in reader.tensors}

    def meta(key: str, default: object = None) -> object:
        value = field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata {arch}.{key} is missing")
        return value

    def meta_int(key: str, default: int | None = None) -> int:
        return _as_int(meta(key, default), f"{arch}.{key}")

    def meta_float(key: str, default: float | None = None) -> float:
        return _as_float(meta(key, default), f"{arch}.{key}")

    heads, hidden = meta_int("attention.head_count"), meta_int("embedding_length")
    head_dim = meta_int("attention.key_length", hidden // heads)
    theta = meta_float("rope.freq_base", 10000.0)
    scaling = (_llama3_scaling(reader.tensor_data(tensors["rope_freqs.weight"]), head_dim, theta)
               if "rope_freqs.weight" in tensors else None)
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    eos = [_as_int(v, k) for k in eos_keys if (v := field(reader, k)) is not None]
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        name=name, vocab_size=tensors["token_embd.weight"].dims[1], hidden_size=hidden,
        intermediate_size=meta_int("feed_forward_length"), num_layers=meta_int("block_count"),
        num_heads=heads, num_kv_heads=meta_int("attention.head_count_kv", heads), head_dim=head_dim,
        max_model_len=meta_int("context_length"), rms_norm_eps=meta_float("attention.layer_norm_rms_epsilon"),
        rope_theta=theta, rope_scaling=scaling, attention_bias="blk.0.attn_q.bias" in tensors,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=None if bos is None else _as_int(bos, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def _llama3_scaling(rope_freqs: np.ndarray, head_dim: int, theta: float) -> Llama3RopeScaling:
    """Find the Llama 3.1-style parameters (low 1, high 4, original 8192; factor = largest divisor)."""
    factors = torch.from_numpy(np.asarray(rope_freqs, dtype=np.float32).copy())
    base = rope_inv_freq(head_dim, theta, None)
    candidate = Llama3RopeScaling(factor=float(factors.max()), low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192)
    scaled = rope_inv_freq(head_dim, theta, candidate)
    if not torch.allclose(base / factors, scaled, rtol=1e-4):
        raise ValueError(f"GGUF rope_freqs does not match llama3 rope scaling {candidate} "
                         f"(max relative error {float(((base / factors) / scaled - 1).abs().max()):.3g})")
    return candidate


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of q/k: rows (head, d/2, 2) → (head, 2, d/2)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(reader: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor) for every weight, dequantised; a tied head is not yielded."""
    permuted = str(field(reader, "general.architecture")) == "llama"
    for t in reader.tensors:
        if t.name in _NOT_WEIGHTS:
            continue
        w: np.ndarray = dequantize(reader.tensor_data(t), t.ggml_type).astype(np.float32, copy=False)
        w = w.reshape(t.shape)
        if permuted and ".attn_q." in t.name:
            w = _unpermute(w, config.num_heads)
        elif permuted and ".attn_k." in t.name:
            w = _unpermute(w, config.num_kv_heads)
        if not w.flags.writeable or not w.flags.c_contiguous:  # F32 tensors are views of the read-only mmap
            w = np.array(w, copy=True, order="C")
        yield hf_name(t.name), torch.from_numpy(w)


def has_tokenizer(reader: GGUFFile) -> bool:
    return "tokenizer.ggml.model" in reader.fields


def open_gguf(path: Path) -> GGUFFile:
    """The file checked complete (gguf_file.GGUFFormatError otherwise), its header read."""
    return read_gguf(path)
