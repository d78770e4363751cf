from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.kernels.prefill_attention import prefill_attention_ref

CASES = [  # q heads, kv heads, head dim, block size, [(query length, cached prefix), ...]
    (1, 1, 64, 16, [(1, 0), (15, 0), (17, 0)]),
    (3, 1, 64, 16, [(100, 0), (5, 32), (17, 33)]),  # prefixes ending on / just past a block boundary
    (9, 3, 64, 16, [(16, 16), (1, 20)]),
    (2, 2, 48, 8, [(19, 5)]),  # head_dim not a power of two: padded tile, masked
]


def _run(case: tuple, dtype: torch.dtype, randn: Callable, paged_kv: Callable, device: str, config: tuple | None):
    from pdserve.kernels.prefill_attention_triton import _launch

    q_heads, kv_heads, dim, block_size, chunks = case
    seq_lens = [q_len + prefix for q_len, prefix in chunks]
    cache, tables = paged_kv(seq_lens, kv_heads, dim, block_size, dtype)
    cu = torch.tensor([0] + [q_len for q_len, _ in chunks], device=device).cumsum(0).to(torch.int32)
    q = randn(int(cu[-1]), q_heads, dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = dim**-0.5
    out = _launch(q, cache, cu, lens, tables, scale, config=config)
    return out, prefill_attention_ref(q, cache, cu, lens, tables, scale)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}q{c[1]}kv-d{c[2]}-bs{c[3]}")
@pytest.mark.parametrize("tile", [(16, 16), (32, 64)], ids=lambda t: f"m{t[0]}n{t[1]}")
def test_prefill_attention_matches_ref(
    case: tuple, tile: tuple, dtype: torch.dtype,
    randn: Callable, paged_kv: Callable, check: Callable, device: str,
) -> None:
    out, ref = _run(case, dtype, randn, paged_kv, device, (*tile, 4, 2))
    check(out, ref, dtype)


def test_prefill_attention_default_launch(randn: Callable, paged_kv: Callable, check: Callable, device: str) -> None:
    """The dispatcher's path: default tiles (on CUDA the tuned ones), a chunk after a 70-token cached prefix."""
    from pdserve.kernels.prefill_attention_triton import prefill_attention_triton

    cache, tables = paged_kv([70 + 90, 40], 2, 64, 16, torch.float16)
    cu = torch.tensor([0, 90, 130], dtype=torch.int32, device=device)
    lens = torch.tensor([160, 40], dtype=torch.int32, device=device)
    q = randn(130, 8, 64, dtype=torch.float16)
    out = prefill_attention_triton(q, cache, cu, lens, tables, 0.125)
    check(out, prefill_attention_ref(q, cache, cu, lens, tables, 0.125), torch.float16)


def test_prefill_attention_rejects_dtype_mismatch(randn: Callable, paged_kv: Callable, device: str) -> None:
    from pdserve.kernels.prefill_attention_triton import prefill_attention_triton

    cache, tables = paged_kv([4], 1, 64, 16, torch.float16)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="dtype"):
        prefill_attention_triton(randn(4, 1, 64), cache, cu, cu[1:], tables, 0.1)


def test_prefill_attention_many_sequences(randn: Callable, paged_kv: Callable, check: Callable, device: str) -> None:
    """More sequences than one search step compares (150 > 128), lengths across tile boundaries, some after a
    cached prefix: every tile finds its own sequence."""
    from pdserve.kernels.prefill_attention_triton import _launch

    gen = torch.Generator().manual_seed(5)
    q_lens = torch.randint(1, 40, (150,), generator=gen).tolist()
    prefixes = [int(p) * (i % 3 == 0) for i, p in enumerate(torch.randint(0, 40, (150,), generator=gen))]
    seq_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    cache, tables = paged_kv(seq_lens, 1, 16, 8, torch.float32)
    cu = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = randn(int(cu[-1]), 2, 16)
    out = _launch(q, cache, cu, lens, tables, 0.25, config=(16, 16, 4, 1))
    check(out, prefill_attention_ref(q, cache, cu, lens, tables, 0.25), torch.float32)
