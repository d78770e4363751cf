"""Triton SiLU-and-mul (the SwiGLU gate): out = silu(gate) * up, fp32 math, one read of x, one write of out.

What is compiled: one kernel per model and dtype (BLOCK and EVEN come from the MLP width, the strides are the
row widths); the token count is only the grid.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, inter, stride_x, stride_out,
    BLOCK: tl.constexpr, EVEN: tl.constexpr,
):
    # x: [num_tokens, 2 * inter] (gate | up); out: [num_tokens, inter]; grid: (num_tokens, cdiv(inter, BLOCK))
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    gate_ptrs = x_ptr + row * stride_x + cols
    if EVEN:
        gate = tl.load(gate_ptrs).to(tl.float32)
        up = tl.load(gate_ptrs + inter).to(tl.float32)
    else:
        mask = cols < inter
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    out = out.to(out_ptr.dtype.element_ty)
    if EVEN:
        tl.store(out_ptr + row * stride_out + cols, out)
    else:
        tl.store(out_ptr + row * stride_out + cols, out, mask=cols < inter)


def _launch(x, config=None):
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate | up), got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    # H200, 4096 x 14336 bf16: 2048-wide blocks / 4 warps 3.88 TB/s, 1024 / 4 3.86 (within noise;
    # python benchmarks/kernels.py --sweep --only small)
    block, num_warps = config or (min(2048, triton.next_power_of_2(inter)), 4)
    if x2.shape[0] and inter:
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, EVEN=inter % block == 0, num_warps=num_warps
        )
    return out.view(*x.shape[:-1], inter)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    return _launch(x)
