"""Triton SiLU-and-mul (the SwiGLU gate): out = silu(gate) * up, fp32 math, one read of x, one write of out.

What is compiled: one kernel per model and dtype (BLOCK and EVEN come from the MLP width, the strides are the
row widths); the token count is only the grid. The fp8 form adds one kernel per model (ONE_PASS and BLOCK from
the MLP width).

silu_and_mul_fp8_triton: the same product, rounded to x's dtype as silu_and_mul stores it, then quantized per row
(kernels/fp8_activation.py) by one program a row: where the row fits one block (2 I <= 2 x 16,384: llama3-8b's
14,336) it is read once, held, its amax taken and its codes written; wider rows are read twice (an amax pass,
then a cast pass, each recomputing silu(gate) * up). Against silu_and_mul + quantize_rows_fp8_triton: one kernel
instead of two, and the [M, I] bf16 product never written and read back (4 bytes an element: 235 MB at 4,096
rows of llama3-8b).
"""

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8_activation import Fp8Activation
from pdserve.kernels.fp8_weight import FP8_DTYPE, FP8_MAX
from pdserve.kernels.linear_fp8_triton import ONE_PASS_MAX_K, _round_to_e4m3
from pdserve.kernels.pdl import launch_options


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, inter, stride_x, stride_out,
    BLOCK: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr = False,
):
    # x: [num_tokens, 2 * inter] (gate | up); out: [num_tokens, inter]; grid: (num_tokens, cdiv(inter, BLOCK))
    if PDL:  # kernels/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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


@triton.jit
def _silu_mul_block(x_ptr, row, cols, inter, stride_x):
    # silu(gate) * up at cols (masked past inter), rounded to x's dtype as silu_and_mul stores it, in fp32
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _store_codes(q_ptr, row, cols, inter, stride_q, v, scale, FP8_MAX: tl.constexpr, ROUND: tl.constexpr):
    q = tl.clamp(v / scale, -FP8_MAX, FP8_MAX)
    if ROUND:
        q = _round_to_e4m3(q)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < inter)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr, q_ptr, s_ptr, inter, stride_x, stride_q,
    BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, FP8_MAX: tl.constexpr, ROUND: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # x: [num_tokens, 2 * inter] (gate | up); q: [num_tokens, inter] e4m3; s: [num_tokens] fp32; grid: (num_tokens,)
    # ONE_PASS: BLOCK >= inter, the row is computed once and held; else an amax pass and a cast pass
    if PDL:  # kernels/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        v = _silu_mul_block(x_ptr, row, cols, inter, stride_x)
        scale = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12) / FP8_MAX
        tl.store(s_ptr + row, scale)
        _store_codes(q_ptr, row, cols, inter, stride_q, v, scale, FP8_MAX, ROUND)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, inter, BLOCK):
            amax = tl.maximum(amax, tl.abs(_silu_mul_block(x_ptr, row, c0 + tl.arange(0, BLOCK), inter, stride_x)))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX
        tl.store(s_ptr + row, scale)
        for c0 in range(0, inter, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            v = _silu_mul_block(x_ptr, row, cols, inter, stride_x)
            _store_codes(q_ptr, row, cols, inter, stride_q, v, scale, FP8_MAX, ROUND)


def _rows(x):
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate | up), got {x.shape[-1]}")
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x, config=None):
    x2 = _rows(x)
    inter = x2.shape[-1] // 2
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    # H200, 4096 x 14336 bf16: 2048-wide blocks / 4 warps 3.88 TB/s, 1024 / 4 3.86 (within noise;
    # python benchmarks/kernels.py --sweep --only small)
    block, num_warps = config or (min(2048, triton.next_power_of_2(inter)), 4)
    if x2.shape[0] and inter:
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, EVEN=inter % block == 0, num_warps=num_warps,
            **launch_options(x.device),
        )
    return out.view(*x.shape[:-1], inter)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    return _launch(x)


def silu_and_mul_fp8_triton(x: torch.Tensor) -> Fp8Activation:
    """x [..., 2 I] -> silu(gate) * up as an Fp8Activation [M, I] (M the leading dims' product)."""
    x2 = _rows(x)
    m, inter = x2.shape[0], x2.shape[-1] // 2
    q = torch.empty((m, inter), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    width = triton.next_power_of_2(max(inter, 1))
    one_pass = width <= ONE_PASS_MAX_K
    if m and inter:
        _silu_and_mul_fp8_kernel[(m,)](
            x2, q, scale, inter, x2.stride(0), q.stride(0), BLOCK=width if one_pass else 4096, ONE_PASS=one_pass,
            FP8_MAX=FP8_MAX, ROUND=x.device.type != "cuda", num_warps=8 if width <= 4096 else 16,
            **launch_options(x.device),
        )
    return Fp8Activation(q, scale, x.dtype)
