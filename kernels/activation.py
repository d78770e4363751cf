"""SiLU-and-mul: the SwiGLU gate.

silu_and_mul(x) -> silu(x[:, :I]) * x[:, I:]
# x: [num_tokens, 2 * I] (gate first, then up, as the engine fuses gate_proj/up_proj) -> [num_tokens, I]
"""

from __future__ import annotations

import torch

from pdserve.kernels.dispatch import use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from pdserve.kernels.activation_triton import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
