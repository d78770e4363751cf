from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.engine.config import Llama3RopeScaling
from pdserve.kernels.rope import build_cos_sin_cache, rope_kv_write_ref

LLAMA3 = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


@pytest.mark.parametrize(
    "tokens,q_heads,kv_heads,dim,block_size",
    [(1, 1, 1, 64, 16), (15, 3, 1, 64, 16), (17, 9, 3, 64, 16), (5, 4, 2, 96, 4), (3, 2, 2, 6, 2)],
)
def test_rope_kv_write_matches_ref(
    tokens: int, q_heads: int, kv_heads: int, dim: int, block_size: int,
    dtype: torch.dtype, randn: Callable, check: Callable, device: str,
) -> None:
    from pdserve.kernels.rope_triton import rope_kv_write_triton

    cos_sin = build_cos_sin_cache(dim, 256, 500000.0, LLAMA3).to(device)
    qkv = randn(tokens, q_heads + 2 * kv_heads, dim, dtype=dtype)  # strided views, as the fused QKV projection gives
    q, k, v = qkv.split([q_heads, kv_heads, kv_heads], dim=1)
    positions = torch.randint(0, 256, (tokens,), device=device)
    num_blocks = (tokens + block_size - 1) // block_size + 2
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[::3] = -1  # padding rows: not written
    cache = randn(2, num_blocks, block_size, kv_heads, dim, dtype=dtype)
    q_ref, k_ref, cache_ref = q.clone(), k.clone(), cache.clone()
    rope_kv_write_ref(q_ref, k_ref, v, positions, cos_sin, cache_ref, slots)

    out = rope_kv_write_triton(q, k, v, positions, cos_sin, cache, slots)
    assert out.data_ptr() == q.data_ptr()
    check(q, q_ref, dtype)
    check(k, k_ref, dtype)  # rotated in place, padding rows too
    check(cache, cache_ref, dtype)


def test_rope_rejects_odd_head_dim(randn: Callable, device: str) -> None:
    from pdserve.kernels.rope_triton import rope_kv_write_triton

    q, k = randn(2, 1, 5), randn(2, 1, 5)
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="even head_dim"):
        rope_kv_write_triton(q, k, k, pos, randn(4, 5), randn(2, 1, 16, 1, 5), pos)
