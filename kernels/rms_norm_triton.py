"""Triton RMSNorm and residual-add + RMSNorm: one pass over each row, fp32 statistics.

The fused form reads x and residual once and writes both the normalised row and h = x + residual, so the
decoder layer never re-reads h to normalise it (4 row transfers instead of 6).

What is compiled: HAS_RESIDUAL and the (BLOCK_ROWS, BLOCK_H, num_warps) of `_config`, functions of the hidden
size and dtype only, and the model's row strides; num_rows, the one per-batch integer, is do_not_specialize.
So two kernels per model and dtype (plain and fused), whatever the batch, and two more where an fp8 linear
follows (QUANT).

QUANT: instead of the normalised row, write its per-row fp8 form (kernels/fp8_activation.py): the row, rounded to
x's dtype as the plain kernel stores it, its amax (the program holds the whole row: BLOCK_H >= hidden), then
e4m3 codes of row / (amax / 448) and the scale, as kernels/linear_fp8_triton.py's one-pass quantization does
from the stored row. One kernel instead of two, and the normalised row is never written and read back in bf16
(4 bytes an element of hidden less per fp8 linear: 4096 x 4096 rows, 67 MB).
"""

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8_activation import Fp8Activation
from pdserve.kernels.fp8_weight import FP8_DTYPE, FP8_MAX
from pdserve.kernels.linear_fp8_triton import _round_to_e4m3
from pdserve.kernels.pdl import launch_options


@triton.jit(do_not_specialize=["num_rows"])  # the token count: one kernel for every batch
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, s_ptr,
    num_rows, hidden, stride_x, stride_res, stride_out, stride_h, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
    QUANT: tl.constexpr, FP8_MAX: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr = False,
):
    # x, residual, out, h: [num_rows, hidden] (unit stride along hidden); weight: [hidden]. QUANT: out is e4m3,
    # s [num_rows] fp32 its row scales; ROUND: round to e4m3 in fp32 before the cast (the interpreter's cast
    # rounds wrongly, kernels/linear_fp8_triton.py says how)
    if PDL:  # kernels/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < hidden)
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows64 * stride_res + cols[None, :], mask=mask, other=0.0)
        # the reference rounds h to x's dtype before normalising it; so do we, to match it bit for bit
        x = (x.to(tl.float32) + res.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + rows64 * stride_h + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / hidden + eps)  # [BLOCK_ROWS]
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    out = xf * rstd[:, None] * w[None, :]
    if QUANT:
        out = out.to(x_ptr.dtype.element_ty).to(tl.float32)  # the plain kernel's stored row, exactly
        scale = tl.maximum(tl.max(tl.abs(out), axis=1), 1e-12) / FP8_MAX  # [BLOCK_ROWS]
        tl.store(s_ptr + rows, scale, mask=rows < num_rows)
        out = tl.clamp(out / scale[:, None], -FP8_MAX, FP8_MAX)
        if ROUND:
            out = _round_to_e4m3(out)
    tl.store(out_ptr + rows64 * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _config(hidden: int, element_size: int) -> tuple:
    """(BLOCK_ROWS, BLOCK_H, num_warps): ~8 KB of each input per program, 4 warps per 8 KB (16-byte accesses,
    4 per thread). H200, 16384 x 4096 bf16 add+norm: 1 row / 4 warps 3.99 TB/s, 8 warps 3.98 (do_bench; 4.00-4.07
    in graph replay; python benchmarks/kernels.py --sweep --only small)."""
    block_h = triton.next_power_of_2(hidden)
    row_bytes = block_h * element_size
    block_rows = max(1, min(16, 8192 // row_bytes))
    num_warps = max(1, min(16, block_rows * row_bytes // 2048))
    return block_rows, block_h, num_warps


def _as_rows(t: torch.Tensor, name: str, hidden: int) -> torch.Tensor:
    if t.shape[-1] != hidden:
        raise ValueError(f"{name} has last dim {t.shape[-1]}, expected hidden={hidden}")
    rows = t.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows


def _launch(x, residual, weight, eps, config=None, quant=False):
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != (hidden={hidden},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    x2 = _as_rows(x, "x", hidden)
    res2 = _as_rows(residual, "residual", hidden) if residual is not None else x2
    out = torch.empty(x2.shape, dtype=FP8_DTYPE if quant else x.dtype, device=x.device)
    h = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    scale = torch.empty((x2.shape[0],), dtype=torch.float32, device=x.device) if quant else out
    num_rows = x2.shape[0]
    block_rows, block_h, num_warps = config or _config(hidden, x.element_size())
    grid = (triton.cdiv(num_rows, block_rows),)
    if num_rows:
        _rms_norm_kernel[grid](
            x2, res2, weight.contiguous(), out, h, scale,
            num_rows, hidden, x2.stride(0), res2.stride(0), out.stride(0), h.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_H=block_h,
            QUANT=quant, FP8_MAX=FP8_MAX, ROUND=quant and x.device.type != "cuda", num_warps=num_warps,
            **launch_options(x.device),
        )
    if quant:
        return Fp8Activation(out, scale, x.dtype), h.view(x.shape)
    return out.view(x.shape), h.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps)


def rms_norm_fp8_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Activation:
    return _launch(x, None, weight, eps, quant=True)[0]


def fused_add_rms_norm_fp8_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Fp8Activation, torch.Tensor]:
    return _launch(x, residual, weight, eps, quant=True)
