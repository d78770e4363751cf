"""Kernel tests compare each `op_triton` with its `op_ref`.

Without a GPU the Triton launchers run under the interpreter (TRITON_INTERPRET=1), which must be set before
triton or any kernel module is imported: conftest is imported first. On CUDA they run compiled, and bf16 is
added (the interpreter's bf16 arithmetic is wrong, so CPU runs skip it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    # tests/conftest.py sets it before anything runs; a triton imported earlier without it would fail every
    # kernel test with "Cannot call @triton.jit'd outside of the scope of a kernel", so say so once instead
    if "triton" in sys.modules:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        assert isinstance(tl.cdiv, InterpretedFunction), \
            "triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it first)"

import pytest

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])

# max |out - ref| / max(|ref|, 1) allowed: fp32 kernels do exact fp32 math (the GPU's fp32 exp2/division
# are not correctly rounded, hence 1e-4 there); fp16/bf16 outputs are rounded once more than the reference's
TOLERANCE = {torch.float32: 1e-4 if DEVICE == "cuda" else 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def randn() -> Callable[..., torch.Tensor]:
    """randn(*shape, dtype=...) on the test device, seeded per test (fresh draws within a test)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def draw(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)

    return draw


@pytest.fixture
def check() -> Callable[..., None]:
    """check(out, ref, dtype, scale=1.0): shapes, dtypes, no NaN, |out - ref| within the dtype's tolerance."""
    return _assert_close


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    assert out.shape == ref.shape, (tuple(out.shape), tuple(ref.shape))
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    diff = (out.float() - ref.float()).abs()
    assert not torch.isnan(out.float()).any(), "NaN in output"
    bound = TOLERANCE[dtype] * scale * ref.float().abs().clamp_min(1.0)
    worst = (diff - bound).max().item() if diff.numel() else 0.0
    assert worst <= 0, f"max |diff| {diff.max().item():.3g} exceeds tolerance ({dtype}, scale {scale})"


@pytest.fixture
def paged_kv(randn: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """paged_kv(seq_lens, kv_heads, dim, block_size, dtype) -> (kv_cache, block_tables int32).

    Each sequence gets distinct blocks in shuffled order; table entries past a sequence's blocks point at
    spare blocks of random data (valid ids: the batched decode reference gathers them before masking), so a
    kernel that attends past seq_len gets a wrong answer instead of passing.
    """

    def build(
        seq_lens: list[int], kv_heads: int, dim: int, block_size: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        needed = [(n + block_size - 1) // block_size for n in seq_lens]
        num_blocks = sum(needed) + 3
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        spare = torch.tensor(order[sum(needed):], dtype=torch.int32)
        width = max(needed + [0]) + 1
        tables = spare[torch.arange(len(seq_lens) * width) % len(spare)].reshape(len(seq_lens), width)
        for i, count in enumerate(needed):
            tables[i, :count] = torch.tensor(order[:count], dtype=torch.int32)
            order = order[count:]
        cache = randn(2, num_blocks, block_size, kv_heads, dim, dtype=dtype)
        return cache, tables.to(DEVICE)

    return build
