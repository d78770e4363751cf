"""The vectorised decode_attention_ref against the per-sequence definition (gather one sequence, attend)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.decode_attention import decode_attention_ref
from pdserve.kernels.paged import attend_ref, gather_sequence_kv


def per_sequence(q, kv_cache, seq_lens, block_tables, scale):
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len:
            k, v = gather_sequence_kv(kv_cache, block_tables[i], seq_len)
            out[i : i + 1] = attend_ref(q[i : i + 1], k, v, scale, prefix=seq_len - 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "seq_lens"),
                         [(9, 3, [1, 40, 0, 17]), (4, 4, [16, 3]), (2, 1, [0])])
def test_matches_per_sequence_definition(dtype, heads, kv_heads, seq_lens) -> None:
    gen = torch.Generator().manual_seed(0)
    block_size, dim, num_blocks = 8, 32, 40
    kv = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: 4 * len(seq_lens)].view(len(seq_lens), 4).int()
    tables = torch.cat([tables, torch.zeros(len(seq_lens), 3, dtype=torch.int32)], dim=1)  # static width
    q = torch.randn(len(seq_lens), heads, dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = decode_attention_ref(q, kv, lens, tables, dim**-0.5)
    expected = per_sequence(q, kv, lens, tables, dim**-0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=1e-6 if dtype == torch.float32 else 1e-3, rtol=0)
    assert not out[lens == 0].any()
