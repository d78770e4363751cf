"""SiLU-and-mul: the SwiGLU gate.

silu_and_mul(x) -> silu(x[:, :I]) * x[:, I:]
# x: [num_tokens, 2 * I] (gate first, then up, as the engine fuses gate_proj/up_proj) -> [num_tokens, I]
silu_and_mul_fp8(x) -> that product as an Fp8Activation (kernels/fp8_activation.py), for an fp8 linear: rounded
to x's dtype, then quantized per row in the same kernel; codes and scales equal quantize_rows_fp8_ref(product)
"""

from __future__ import annotations

import torch

from pdserve.kernels.dispatch import use_triton
from pdserve.kernels.fp8_activation import Fp8Activation, quantize_activation_ref


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def silu_and_mul_fp8_ref(x: torch.Tensor) -> Fp8Activation:
    return quantize_activation_ref(silu_and_mul_ref(x))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from pdserve.kernels.activation_triton import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Activation:
    if use_triton(x):
        from pdserve.kernels.activation_triton import silu_and_mul_fp8_triton

        return silu_and_mul_fp8_triton(x)
    return silu_and_mul_fp8_ref(x)
