"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache, built from `kernels` ops.

One decoder layer, T packed tokens, hidden H, Hq query / Hkv key-value heads of size D, MLP width I:

    h ─▶ (+ residual) RMSNorm ─▶ qkv = x @ Wqkv.T (+ b)      [T, (Hq + 2 Hkv) D], q|k|v rows fused at load
                                 rope_kv_write(q, k, v)       q, k rotated in place; k and v written to slots
                                 ──▶ layer_done(i)            the layer's KV is in the cache (prefill only)
                                 attention                    prefill: varlen chunks over the cache (or SDPA on
                                                              k, v for whole uncached prompts); decode: 1 token/row
                                 @ Wo.T                       [T, H]
      ─▶ (+ residual) RMSNorm ─▶ silu(x @ Wg.T) * (x @ Wu.T)  one GEMM over [gate | up] fused at load
                                 @ Wdown.T                    [T, H]

Where the linear after a norm or after silu_and_mul holds fp8 weights (--quantization fp8), that kernel's fp8
form runs instead (rms_norm_fp8, fused_add_rms_norm_fp8, silu_and_mul_fp8): it also quantizes its output per
token, and the linear takes those codes and scales (kernels/fp8_activation.py) instead of quantizing x itself.
The logits are the same; qkv, gate_up and down lose a kernel each. o_proj's input comes from attention and is
quantized by the linear.

Logits are computed only for the rows that are sampled. The decode forward has no data-dependent Python
control flow and reads only DecodeBuffers' static tensors, so a CUDA graph can capture it per batch bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import torch

from pdserve import kernels
from pdserve.engine.attention_metadata import DecodeBatch, PrefillBatch
from pdserve.engine.config import ModelConfig
from pdserve.engine.kv_cache_spec import KVCacheSpec
from pdserve.engine.weights.fp8_checkpoint import cat_fp8, fp8_linear, is_fp8
from pdserve.kernels.fp8_activation import Fp8Activation
from pdserve.kernels.fp8_weight import Fp8Weight, dequantize_weight_fp8, quantize_weight_fp8
from pdserve.kernels.linear_fp8 import quantizes_activations

QUANTIZATIONS = ("none", "fp8")
LayerDone = Callable[[int], None]
Tick = Callable[[], None]
# rows of lm_head per GEMM when a prefill asks for many logits (prompt logprobs): a 1,400-row prompt's [1400, 49152]
# fp32 logits are ~1 s of CPU in one GEMM, past the step-liveness tick of a layer; a tick between slices keeps the
# step thread seen moving (engine/step_liveness.py)
LOGIT_ROWS_PER_SLICE = 256
# (q [T, Hq, D], k, v [T, Hkv, D] (rotated), kv_cache, k_scale, v_scale) -> [T, Hq, D]
Attend = Callable[..., torch.Tensor]


Linear: TypeAlias = torch.Tensor | Fp8Weight  # [N, K] in the model dtype, or fp8 with per-row scales (--quantization fp8)
Activation: TypeAlias = torch.Tensor | Fp8Activation  # a linear's input: [T, K] in the model dtype, or its fp8 rows
# False: fp8 linears quantize their inputs themselves (a kernel of their own, the same numbers). Not a user
# setting: benchmarks/engine_gpu.py's fp8-unfused run sets it to time the fusion against that form
FUSE_FP8_ACTIVATIONS = True


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Linear  # [(Hq + 2 Hkv) D, H]: q rows, then k, then v
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D] (Qwen2)
    o_proj: Linear  # [H, Hq D]
    post_norm: torch.Tensor  # [H]
    gate_up: Linear  # [2 I, H]: gate rows, then up (kernels.silu_and_mul's layout)
    down: Linear  # [H, I]


@dataclass(frozen=True)
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the same tensor as embed when the embeddings are tied


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    c = config
    shapes: dict[str, tuple[int, ...]] = {}
    shapes["model.embed_tokens.weight"] = (c.vocab_size, c.hidden_size)
    shapes["model.norm.weight"] = (c.hidden_size,)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        for name, rows in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, c.hidden_size)
            if c.attention_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    return shapes


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    shapes = _expected_shapes(config)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    missing = sorted(set(shapes) - set(weights))
    if missing:
        raise ValueError(f"{len(missing)} weights missing for {config.name}, e.g. {missing[:4]}")
    wrong = [f"{k}: {tuple(weights[k].shape)} (expected {s})" for k, s in shapes.items()
             if tuple(weights[k].shape) != s]
    if wrong:
        raise ValueError(f"{len(wrong)} weights of {config.name} have the wrong shape, e.g. {wrong[:4]}")


def fuse_weights(
    config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype,
    quantization: str = "none",
) -> ModelWeights:
    """HF-named weights -> ModelWeights on `device` in `dtype`, q/k/v and gate/up concatenated.

    quantization "fp8": every linear of the layers (qkv, o, gate_up, down) becomes an Fp8Weight, quantized
    per output channel here or taken as stored from an FP8 checkpoint; embeddings, norms and lm_head stay in
    `dtype` (as vLLM keeps them). "none": linears in `dtype` (an FP8 checkpoint's dequantized)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {QUANTIZATIONS}")
    _check_weights(config, weights)

    def get(name: str) -> torch.Tensor:
        if is_fp8(weights[name]):
            raise ValueError(f"{name} is fp8 in the checkpoint; only the layers' linears may be")
        return weights[name].to(device=device, dtype=dtype)

    def fp8(weight: Fp8Weight) -> Fp8Weight:
        if weight.device.type == "cpu":
            weight.dequantized()  # the references' fp32 copy, made now, at load, not in a first step
        return weight

    def linear(*prefixes: str) -> Linear:
        if is_fp8(weights[prefixes[0] + ".weight"]):
            stored = cat_fp8([fp8_linear(weights, p, device) for p in prefixes])
            return fp8(stored) if quantization == "fp8" else dequantize_weight_fp8(stored, dtype)
        fused = torch.cat([get(p + ".weight") for p in prefixes])
        return fp8(quantize_weight_fp8(fused)) if quantization == "fp8" else fused

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        bias = None
        if config.attention_bias:
            bias = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        layers.append(LayerWeights(
            input_norm=get(p + "input_layernorm.weight"),
            qkv=linear(*(p + f"self_attn.{n}_proj" for n in "qkv")),
            qkv_bias=bias,
            o_proj=linear(p + "self_attn.o_proj"),
            post_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=linear(p + "mlp.gate_proj", p + "mlp.up_proj"),
            down=linear(p + "mlp.down_proj"),
        ))
    embed = get("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
    return ModelWeights(embed=embed, layers=layers, norm=get("model.norm.weight"), lm_head=lm_head)


class LlamaModel:
    """The forward passes. Holds weights and the RoPE table; KV caches are passed in (owned by the runner), of
    `kv_spec`'s dtype, whose per-layer scales the K/V write and attention kernels are given (fp8 caches)."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, kv_spec: KVCacheSpec | None = None) -> None:
        self.config = config
        self.weights = weights
        self.kv_spec = kv_spec if kv_spec is not None else KVCacheSpec(weights.embed.dtype)
        device = weights.embed.device
        self.cos_sin_cache = kernels.build_cos_sin_cache(
            config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling
        ).to(device)
        self.scale = config.head_dim**-0.5

    def forward_prefill(
        self, batch: PrefillBatch, kv_caches: list[torch.Tensor], layer_done: LayerDone | None = None,
        tick: Tick | None = None,
    ) -> torch.Tensor:
        """Packed chunks -> fp32 logits [len(batch.logits_indices), V]; KV of every chunk token is cached.
        tick() is called after each slice of LOGIT_ROWS_PER_SLICE logit rows when there are more than that."""

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, k_scale: float,
                   v_scale: float) -> torch.Tensor:
            return kernels.prefill_attention(
                q, kv_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, self.scale, k, v, batch.shape,
                k_scale, v_scale,
            )

        h, residual = self._layers(batch.input_ids, batch.positions, batch.slot_mapping, kv_caches, attend,
                                   layer_done)
        rows = batch.logits_indices
        if rows.shape[0] <= LOGIT_ROWS_PER_SLICE:
            return self._logits(h[rows], residual[rows])
        out = torch.empty(rows.shape[0], self.weights.lm_head.shape[0], dtype=torch.float32, device=h.device)
        for start in range(0, rows.shape[0], LOGIT_ROWS_PER_SLICE):
            part = rows[start:start + LOGIT_ROWS_PER_SLICE]
            out[start:start + part.shape[0]] = self._logits(h[part], residual[part])
            if tick is not None:
                tick()
        return out

    def forward_decode(self, batch: DecodeBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """One token per row (padding included) -> fp32 logits [bucket, V]."""

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, k_scale: float,
                   v_scale: float) -> torch.Tensor:
            return kernels.decode_attention(q, kv_cache, batch.seq_lens, batch.block_tables, self.scale, k_scale,
                                            v_scale)

        h, residual = self._layers(batch.input_ids, batch.positions, batch.slot_mapping, kv_caches, attend,
                                   None)
        return self._logits(h, residual)

    def _layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attend: Attend,
        layer_done: LayerDone | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the last layer's output and the residual stream (their sum is the final hidden state)."""
        c = self.config
        h = torch.nn.functional.embedding(input_ids, self.weights.embed)
        residual: torch.Tensor | None = None  # the first layer's norm has no add
        for i, w in enumerate(self.weights.layers):
            x, residual = self._norm(h, residual, w.input_norm, w.qkv)
            qkv = kernels.linear(x, w.qkv, w.qkv_bias)
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            num_tokens = qkv.shape[0]
            k = k.view(num_tokens, c.num_kv_heads, c.head_dim)
            v = v.view(num_tokens, c.num_kv_heads, c.head_dim)
            k_scale, v_scale = self.kv_spec.layer_scales(i)
            q = kernels.rope_kv_write(q.view(num_tokens, c.num_heads, c.head_dim), k, v,
                                      positions, self.cos_sin_cache, kv_caches[i], slot_mapping, k_scale, v_scale)
            if layer_done is not None:
                layer_done(i)
            attn = attend(q, k, v, kv_caches[i], k_scale, v_scale)
            h = kernels.linear(attn.reshape(num_tokens, c.q_size), w.o_proj)
            x, residual = self._norm(h, residual, w.post_norm, w.gate_up)
            h = self._mlp(x, w)
        return h, residual

    def _norm(self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              consumer: Linear) -> tuple[Activation, torch.Tensor]:
        """(RMSNorm(h + residual), h + residual), or (RMSNorm(h), h) without a residual; the first in fp8 rows
        when `consumer`, the linear it feeds, is fp8."""
        eps = self.config.rms_norm_eps
        fp8 = _feeds_fp8(consumer, h.shape[0])
        if residual is None:
            return (kernels.rms_norm_fp8 if fp8 else kernels.rms_norm)(h, weight, eps), h
        return (kernels.fused_add_rms_norm_fp8 if fp8 else kernels.fused_add_rms_norm)(h, residual, weight, eps)

    def _mlp(self, x: Activation, w: LayerWeights) -> torch.Tensor:
        gate_up = kernels.linear(x, w.gate_up)
        act = kernels.silu_and_mul_fp8 if _feeds_fp8(w.down, gate_up.shape[0]) else kernels.silu_and_mul
        return kernels.linear(act(gate_up), w.down)

    def _logits(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x, _ = kernels.fused_add_rms_norm(h, residual, self.weights.norm, self.config.rms_norm_eps)
        return kernels.linear(x, self.weights.lm_head).float()


def _feeds_fp8(linear: Linear, num_tokens: int) -> bool:
    """Whether the kernel before `linear` emits fp8 rows: fp8 weights at a W8A8 row count, fusion on."""
    return FUSE_FP8_ACTIVATIONS and isinstance(linear, Fp8Weight) and quantizes_activations(num_tokens)
