from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.kernels.decode_attention import decode_attention_ref

CASES = [  # q heads, kv heads, head dim, block size, seq_lens
    (1, 1, 64, 16, [1, 15, 17]),
    (3, 1, 64, 16, [100, 0, 16]),
    (9, 3, 64, 16, [33, 1]),
    (4, 4, 48, 8, [17, 9]),  # head_dim not a power of two: padded tile, masked
]


def _run(case: tuple, dtype: torch.dtype, randn: Callable, paged_kv: Callable, device: str, splits: int | None):
    from pdserve.kernels.decode_attention_triton import _launch

    q_heads, kv_heads, dim, block_size, seq_lens = case
    cache, tables = paged_kv(seq_lens, kv_heads, dim, block_size, dtype)
    q = randn(len(seq_lens), q_heads, dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = dim**-0.5
    out = _launch(q, cache, lens, tables, scale, num_splits=splits, config=(16, 4, 2))
    return out, decode_attention_ref(q, cache, lens, tables, scale)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}q{c[1]}kv-d{c[2]}-bs{c[3]}")
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_attention_matches_ref(
    case: tuple, splits: int, dtype: torch.dtype, randn: Callable, paged_kv: Callable, check: Callable, device: str
) -> None:
    out, ref = _run(case, dtype, randn, paged_kv, device, splits)
    check(out, ref, dtype)


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_split_partials_summed_by_the_last_program(
    splits: int, randn: Callable, paged_kv: Callable, check: Callable, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """COMBINE (one launch: the split that finishes last sums the partials) against the reduce kernel, empty
    splits and a seq_len 0 row included; every ticket is back at zero after each launch, so the next one (a
    CUDA graph's replay) starts from zero. On the GPU many programs race for the tickets: repeated launches give
    the same bits (split order, whichever program sums)."""
    from pdserve.kernels import decode_attention_sum_triton as sums
    from pdserve.kernels import decode_attention_triton as attention

    monkeypatch.setattr(attention, "_sm_count", lambda _device: 4)  # these few programs fill "the SMs"
    seq_lens = [200, 0, 1, 47] * (8 if device == "cuda" else 1)
    cache, tables = paged_kv(seq_lens, 2, 64, 16, torch.float16)
    q = randn(len(seq_lens), 8, 64, dtype=torch.float16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    reduce_kernel = sums._decode_reduce_kernel
    monkeypatch.setattr(sums, "_decode_reduce_kernel", None)  # not launched
    runs = [attention._launch(q, cache, lens, tables, 0.125, num_splits=splits, config=(16, 4, 2))
            for _ in range(5 if device == "cuda" else 1)]
    assert not sums._tickets[q.device].any()
    monkeypatch.setattr(sums, "_decode_reduce_kernel", reduce_kernel)
    monkeypatch.setattr(sums, "COMBINE_IN_SPLITS", False)
    reduced = attention._launch(q, cache, lens, tables, 0.125, num_splits=splits, config=(16, 4, 2))
    for out in runs:
        assert torch.equal(out, runs[0])
        check(out, reduced, torch.float16)
        check(out, decode_attention_ref(q, cache, lens, tables, 0.125), torch.float16)
    assert not runs[0][1].any()


def test_below_one_program_a_sm_the_reduce_kernel_sums_the_splits(
    randn: Callable, paged_kv: Callable, check: Callable, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where B * Hkv programs do not fill the SMs the fused sum lost (kernels/decode_attention_triton.py):
    no ticket is taken, the reduce kernel runs."""
    from pdserve.kernels import decode_attention_sum_triton as sums
    from pdserve.kernels import decode_attention_triton as attention

    monkeypatch.setattr(attention, "_sm_count", lambda _device: 132)
    monkeypatch.setattr(sums, "ticket_buffer", None)  # not asked for
    cache, tables = paged_kv([300, 5], 2, 64, 16, torch.float16)
    q = randn(2, 8, 64, dtype=torch.float16)
    lens = torch.tensor([300, 5], dtype=torch.int32, device=device)
    out = attention._launch(q, cache, lens, tables, 0.125, num_splits=4, config=(16, 4, 2))
    check(out, decode_attention_ref(q, cache, lens, tables, 0.125), torch.float16)


def test_no_ticket_buffer_first_made_in_a_capture_or_beyond_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without tickets a launch keeps the reduce kernel: a buffer first asked for inside a CUDA graph capture
    (it could not be zeroed there) or more (sequence, kv head) pairs than a buffer holds."""
    from pdserve.kernels import decode_attention_sum_triton as sums

    cpu = torch.device("cpu")
    monkeypatch.setattr(sums, "_tickets", {})
    assert sums.ticket_buffer(cpu, sums._TICKETS + 1) is None
    buffer = sums.ticket_buffer(cpu, 64)
    assert buffer is not None and buffer.dtype == torch.int32 and not buffer.any()
    assert sums.ticket_buffer(cpu, 8) is buffer


def test_decode_attention_default_launch(randn: Callable, paged_kv: Callable, check: Callable, device: str) -> None:
    """The heuristic split count and the default tile, as the dispatcher calls it; seq_len 0 gives zeros."""
    from pdserve.kernels.decode_attention_triton import decode_attention_triton

    cache, tables = paged_kv([300, 0, 5], 2, 64, 16, torch.float16)
    q = randn(3, 8, 64, dtype=torch.float16)
    lens = torch.tensor([300, 0, 5], dtype=torch.int32, device=device)
    out = decode_attention_triton(q, cache, lens, tables, 0.125)
    check(out, decode_attention_ref(q, cache, lens, tables, 0.125), torch.float16)
    assert not out[1].any()


def test_num_splits_heuristic_fills_the_gpu() -> None:
    from pdserve.kernels.decode_attention_triton import num_splits_for

    assert num_splits_for(batch=1, kv_heads=8, max_context=4096, sm_count=132) == 16
    assert num_splits_for(batch=32, kv_heads=8, max_context=4096, sm_count=132) == 1
    assert num_splits_for(batch=8, kv_heads=8, max_context=4096, sm_count=132) == 8
    assert num_splits_for(batch=256, kv_heads=8, max_context=4096, sm_count=132) == 1
    assert num_splits_for(batch=1, kv_heads=8, max_context=100, sm_count=132) == 1


def test_decode_attention_rejects_bad_group(randn: Callable, paged_kv: Callable, device: str) -> None:
    from pdserve.kernels.decode_attention_triton import decode_attention_triton

    cache, tables = paged_kv([4], 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="q heads 3"):
        decode_attention_triton(randn(1, 3, 64), cache, torch.tensor([4], device=device), tables, 0.1)
