"""FP8 checkpoints: which ones load, and their linear weights as kernels' Fp8Weight.

config.json's `quantization_config` says how a checkpoint's linears are stored:

    {"quant_method": "fp8", "activation_scheme": ...}                         (AutoFP8 / vLLM's "fp8")
        <linear>.weight e4m3 [N, K], <linear>.weight_scale fp32 [] or [1] (per tensor) or [N] / [N, 1]
    {"quant_method": "fp8", "weight_block_size": [bn, bk]}                    (DeepSeek-style block-wise)
        <linear>.weight e4m3 [N, K], <linear>.weight_scale_inv fp32 [cdiv(N, bn), cdiv(K, bk)]
    {"quant_method": "compressed-tensors", "format": "float-quantized",
     "config_groups": {..: {"weights": {"type": "float", "num_bits": 8, "strategy": "tensor" | "channel"}}}}
        <linear>.weight e4m3 [N, K], <linear>.weight_scale fp32 [1] or [N, 1]

Per-tensor and per-channel scales become per-channel [N] exactly (a tensor's scale repeated per row), so the
q|k|v and gate|up fusion concatenates them. Block-wise weights are dequantized and quantized again per channel
(one more rounding: the kernels take one scale per row). `input_scale` tensors (static activation scales) are
not used: activations are quantized per token at every call, as `--quantization fp8` does for any checkpoint.
Embeddings, norms and lm_head must be unquantized (they are in every format above). Which configs name an FP8
checkpoint is engine/weights/hf_config.py's checkpoint_quantization (torch-free: the router reads configs).
"""

from __future__ import annotations

import torch

from pdserve.kernels.fp8_weight import FP8_DTYPE, Fp8Weight, quantize_weight_fp8

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)


def fp8_linear(weights: dict[str, torch.Tensor], prefix: str, device: torch.device | str) -> Fp8Weight:
    """`prefix`.weight (e4m3) and its scale tensor -> Fp8Weight on `device` with scale [N]."""
    weight = weights[prefix + ".weight"].to(device)
    n = weight.shape[0]
    if prefix + ".weight_scale_inv" in weights:
        return _from_blocks(weight, weights[prefix + ".weight_scale_inv"].to(device=device, dtype=torch.float32))
    if prefix + ".weight_scale" not in weights:
        raise ValueError(f"{prefix}.weight is fp8 but the checkpoint has no {prefix}.weight_scale")
    scale = weights[prefix + ".weight_scale"].to(device=device, dtype=torch.float32).reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(n)
    if scale.numel() != n:
        raise ValueError(f"{prefix}.weight_scale has {scale.numel()} values; expected 1 or {n} (one per row)")
    return Fp8Weight(weight, scale.contiguous())


def _from_blocks(weight: torch.Tensor, scale_inv: torch.Tensor) -> Fp8Weight:
    """Block-wise scales [cdiv(N, bn), cdiv(K, bk)] -> dequantized, then quantized per channel."""
    n, k = weight.shape
    bn, bk = -(-n // scale_inv.shape[0]), -(-k // scale_inv.shape[1])
    full = scale_inv.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return quantize_weight_fp8(weight.float() * full)


def cat_fp8(parts: list[Fp8Weight]) -> Fp8Weight:
    """Row-wise concatenation (q|k|v, gate|up): exact, since every row keeps its own scale."""
    return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))


def is_fp8(tensor: torch.Tensor) -> bool:
    return bool(tensor.dtype == FP8_DTYPE)
