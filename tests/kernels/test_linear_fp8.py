"""FP8 linear: the (de)quantizers' error bounds, and each Triton kernel against its reference (the interpreter
on CPU, which runs fp8 `tl.dot`s and casts; compiled on the H200, where bf16 is added and llama3-8b shapes run).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.kernels import linear
from pdserve.kernels.fp8_weight import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_WEIGHT_ONLY_MAX_ROWS,
    Fp8Weight,
    dequantize_weight_fp8,
    quantize_rows_fp8_ref,
    quantize_weight_fp8,
)
from pdserve.kernels.linear_fp8 import linear_fp8_ref

CUDA = torch.cuda.is_available()
# e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself; below 2^-6 (in code units) the
# subnormal step is 2^-9, so rounding there is within 2^-10
_REL, _ABS = 2.0**-4, 2.0**-10


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _fp8_weight(randn: Callable[..., torch.Tensor], n: int, k: int) -> Fp8Weight:
    return quantize_weight_fp8(randn(n, k) / k**0.5)


def test_weight_round_trip_within_one_rounding(randn: Callable) -> None:
    w = randn(67, 129) * torch.linspace(0.01, 10, 67, device=randn(1).device)[:, None]  # rows of any scale
    w[5] = 0.0
    q = quantize_weight_fp8(w)
    assert q.weight.dtype == FP8_DTYPE and q.scale.dtype == torch.float32
    assert torch.equal(q.scale, (w.abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX))
    assert q.weight.float().abs().amax(dim=1)[6:].eq(FP8_MAX).all()  # each row's largest maps to 448
    err = (dequantize_weight_fp8(q) - w).abs()
    assert (err <= _REL * w.abs() + _ABS * q.scale[:, None]).all()
    assert err[5].eq(0).all()


def test_rows_round_trip_within_one_rounding(randn: Callable) -> None:
    x = randn(9, 300) * 50
    q, s = quantize_rows_fp8_ref(x)
    err = (q.float() * s[:, None] - x).abs()
    assert (err <= _REL * x.abs() + _ABS * s[:, None]).all()


@pytest.mark.parametrize("rows,k", [(5, 5000), (2, 20000)])
def test_quantize_rows_triton_matches_ref(rows: int, k: int, randn: Callable) -> None:
    """Same scales and codes (the GPU's fp32 division is not correctly rounded, so a code may sit one e4m3 step
    off there, rarely). 5,000 wide: one pass over a row held whole (8,192 lanes, the tail masked); 20,000: above
    ONE_PASS_MAX_K, the amax pass and the cast pass over 4,096-wide blocks, the last partial."""
    from pdserve.kernels.linear_fp8_triton import ONE_PASS_MAX_K, quantize_rows_fp8_triton

    assert (k > ONE_PASS_MAX_K) == (k == 20000)
    x = randn(rows, k) * 3
    x[1] = 0.0  # 10,000+ values: many round up into the next power of two (the interpreter's cast got 1.95 -> 1)
    q, s = quantize_rows_fp8_triton(x)
    q_ref, s_ref = quantize_rows_fp8_ref(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    if not CUDA:
        assert torch.equal(q.float(), q_ref.float())
        return
    assert ((q.float() - q_ref.float()).abs() <= 2.0 * _REL * q_ref.float().abs() + 2.0**-9).all()
    assert (q.float() != q_ref.float()).float().mean() < 1e-3


@pytest.mark.parametrize("m,n,k,use_dot", [(1, 64, 256, True), (3, 48, 100, True), (16, 16, 512, True),
                                           (1, 64, 256, False), (3, 48, 100, False)])
@pytest.mark.parametrize("split_k", [1, 3])
def test_fp8_gemv_matches_ref(m: int, n: int, k: int, use_dot: bool, split_k: int, dtype: torch.dtype,
                              randn: Callable, check: Callable) -> None:
    """Weight-only: x in its dtype, the fp8 weight upcast in registers, its scale applied before split-K."""
    from pdserve.kernels.linear_triton import GemvConfig, gemv_triton

    w, x, bias = _fp8_weight(randn, n, k), randn(m, k, dtype=dtype), randn(n, dtype=dtype)
    cfg = GemvConfig(block_n=16, block_k=32, split_k=split_k, use_dot=use_dot, num_warps=4, num_stages=2)
    ref = x.float() @ dequantize_weight_fp8(w).T  # weight-only: x unquantized
    check(gemv_triton(x, w.weight, bias, cfg, scale=w.scale), (ref + bias.float()).to(dtype), dtype)
    check(gemv_triton(x, w.weight, None, cfg, scale=w.scale), ref.to(dtype), dtype)


@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (5, 96, 256), (17, 96, 256), (40, 50, 200), (130, 64, 64)])
def test_fp8_gemm_matches_ref(m: int, n: int, k: int, dtype: torch.dtype, randn: Callable, check: Callable) -> None:
    """The same quantized x into both: fp8 dots + epilogue scales (+ bias) against fp32 dequantized math.
    M below one tile (decode), odd M, N and K % BLOCK_K != 0 run the modulo rows/columns and the masked K
    tail."""
    from pdserve.kernels.linear_fp8_triton import Fp8GemmConfig, fp8_gemm_triton

    w, bias = _fp8_weight(randn, n, k), randn(n, dtype=dtype)
    xq, sx = quantize_rows_fp8_ref(randn(m, k, dtype=dtype))
    ref = ((xq.float() * sx[:, None]) @ dequantize_weight_fp8(w).T + bias.float()).to(dtype)
    cfg = Fp8GemmConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)
    check(fp8_gemm_triton(xq, sx, w, bias, dtype, cfg), ref, dtype)


@pytest.mark.parametrize("shape", [(1, 256), (2, 3, 256), (17, 256), (40, 256)])
def test_linear_dispatches_fp8_weights(shape: tuple, dtype: torch.dtype, randn: Callable) -> None:
    """linear(x, Fp8Weight) on the kernel path (W8A8 above FP8_WEIGHT_ONLY_MAX_ROWS rows) against
    linear_fp8_ref, leading dims kept; and within fp8's error of the unquantized product."""
    from pdserve.kernels.linear_fp8_triton import linear_fp8_triton

    x, w = randn(*shape, dtype=dtype), randn(96, 256) / 16
    q = quantize_weight_fp8(w)
    out = linear_fp8_triton(x, q)
    ref = linear_fp8_ref(x, q)
    assert out.shape == ref.shape == (*shape[:-1], 96) and out.dtype == dtype
    assert _rel(out, ref) < 1e-2  # rounding only (and a GPU code one step off, rarely)
    assert _rel(linear(x, q), ref) < 1e-2  # the dispatcher: the reference on CPU, these kernels on CUDA
    assert _rel(ref, x.float() @ w.T) < 0.06  # fp8 error: ~2^-5 relative per operand


@pytest.mark.skipif(not CUDA, reason="llama3-8b shapes compiled on the GPU")
@pytest.mark.parametrize("m", [1, 8, 64, 512])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_fp8_linear_llama3_shapes_cuda(m: int, n: int, k: int) -> None:
    """bf16 activations at llama3-8b's qkv and down shapes against the reference, and (W8A8 rows) against
    torch._scaled_mm on the same fp8 operands."""
    from pdserve.kernels.linear_fp8_triton import fp8_gemm_triton, quantize_rows_fp8_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = quantize_weight_fp8(torch.randn(n, k, device="cuda", generator=gen) / k**0.5)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    out, ref = linear(x, w), linear_fp8_ref(x, w)
    assert _rel(out, ref) < 1e-2
    if m > FP8_WEIGHT_ONLY_MAX_ROWS and m % 16 == 0:
        xq, sx = quantize_rows_fp8_triton(x)
        ours = fp8_gemm_triton(xq, sx, w, None, torch.bfloat16)
        theirs = torch._scaled_mm(xq, w.weight.T, scale_a=sx[:, None], scale_b=w.scale[None, :],
                                  out_dtype=torch.bfloat16)
        assert _rel(ours, theirs) < 5e-3


@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (3, 96, 512), (16, 64, 200), (17, 130, 256), (64, 64, 384)])
@pytest.mark.parametrize("split_k", [1, 3])
def test_fp8_skinny_matches_ref(m: int, n: int, k: int, split_k: int, dtype: torch.dtype, randn: Callable,
                                check: Callable) -> None:
    """The decode-batch W8A8 kernel on the same quantized x as the reference: swapped operands, split-K
    partials, odd N (columns read modulo N), K tails, 16/32/64-row tiles, bias on the direct and the split path."""
    from pdserve.kernels.linear_fp8_skinny_triton import Fp8SkinnyConfig, fp8_skinny_triton

    w, bias = _fp8_weight(randn, n, k), randn(n, dtype=dtype)
    x = randn(m, k, dtype=dtype) * 3
    x[m // 2] = 0.0  # a row of zeros: its scale is the floor, its codes zero
    xq, sx = quantize_rows_fp8_ref(x)
    ref = (xq.float() * sx[:, None]) @ dequantize_weight_fp8(w).T
    cfg = Fp8SkinnyConfig(block_n=32, block_k=64, split_k=split_k, num_warps=4, num_stages=2)
    check(fp8_skinny_triton(xq, sx, w, bias, dtype, cfg), (ref + bias.float()).to(dtype), dtype)
    check(fp8_skinny_triton(xq, sx, w, None, dtype, cfg), ref.to(dtype), dtype)


def test_fp8_skinny_refuses_more_rows_than_its_tiles(randn: Callable) -> None:
    from pdserve.kernels.linear_fp8_skinny_triton import Fp8SkinnyConfig, fp8_skinny_triton

    xq, sx = quantize_rows_fp8_ref(randn(65, 128))
    with pytest.raises(ValueError, match="1..64 rows"):
        fp8_skinny_triton(xq, sx, _fp8_weight(randn, 64, 128), None, torch.float32, Fp8SkinnyConfig())


def test_fp8_skinny_configs_come_from_the_device_table() -> None:
    """The shipped table's entry for the device, shape and row bucket; the heuristic where there is none."""
    from pdserve.kernels.linear_fp8_skinny_triton import (
        Fp8SkinnyConfig,
        config_key,
        configs_table,
        skinny_config,
    )

    key = config_key("NVIDIA H200", 4096, 14336, 1)
    assert key in configs_table().entries  # measured on the H200 (benchmarks/linear_fp8_skinny_gpu.py)
    assert config_key("NVIDIA H200", 4096, 14336, 2) == config_key("NVIDIA H200", 4096, 14336, 8)
    assert config_key("NVIDIA H200", 4096, 14336, 33) == config_key("NVIDIA H200", 4096, 14336, 64)
    # no entry for the device: the H100 sweep's picks (unsplit; wider tiles for gate_up's 28,672 rows)
    assert skinny_config(1, 4096, 14336, torch.device("cpu")) == Fp8SkinnyConfig(64, 256, 1, 4, 5)
    assert skinny_config(64, 28672, 4096, torch.device("cpu")) == Fp8SkinnyConfig(128, 256, 1, 4, 3)
