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
    cached prefix: every tile finds its own sequence. One query head: the tile -> sequence search is the same in
    every head's programs (the grid's first axis), and the interpreter runs each (GQA: the cases above)."""
    from pdserve.kernels.prefill_attention_triton import _launch

    gen = torch.Generator().manual_seed(5)
    q_lens = torch.randint(1, 24, (150,), generator=gen).tolist()
    prefixes = [int(p) * (i % 3 == 0) for i, p in enumerate(torch.randint(0, 24, (150,), generator=gen))]
    seq_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    cache, tables = paged_kv(seq_lens, 1, 16, 8, torch.float32)
    cu = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = randn(int(cu[-1]), 1, 16)
    out = _launch(q, cache, cu, lens, tables, 0.25, config=(16, 16, 4, 1))
    check(out, prefill_attention_ref(q, cache, cu, lens, tables, 0.25), torch.float32)


def test_sdpa_takes_only_whole_uncached_prompts_the_entry_allows() -> None:
    from pdserve.kernels.prefill_attention import PrefillShape, sdpa_choice

    entry = {"backend": "flash", "min_tokens": 1024, "max_seqs": 2}
    assert sdpa_choice(PrefillShape((4096,), cached=False), entry) == "flash"
    assert sdpa_choice(PrefillShape((1024, 2000), cached=False), entry) == "flash"
    assert sdpa_choice(PrefillShape((4096,), cached=True), entry) is None  # a prefix: K/V live in the pages
    assert sdpa_choice(PrefillShape((4096, 1023), cached=False), entry) is None  # one prompt too short
    assert sdpa_choice(PrefillShape((2048,) * 3, cached=False), entry) is None  # one call each: too many
    assert sdpa_choice(PrefillShape((4096,), cached=False), None) is None  # nothing measured: ours
    assert sdpa_choice(None, entry) is None
    assert sdpa_choice(PrefillShape((8192, 8192), cached=False), {"backend": "cudnn", "min_tokens": 1}) is None


def _backends(device: str) -> list[str]:
    return ["math"] + (["flash", "cudnn", "efficient"] if device == "cuda" else [])


def test_sdpa_buckets_hold_every_length_the_dispatch_pads_to() -> None:
    """The warm-up runs sdpa_buckets(entry, limit); every prompt the entry sends to SDPA, of up to the limit,
    must run at one of those lengths (sdpa_bucket), else cuDNN plans it on a request."""
    from pdserve.kernels.prefill_attention import sdpa_bucket, sdpa_buckets

    assert [sdpa_bucket(n, 256) for n in (1, 255, 256, 257, 4096, 4097)] == [256, 256, 256, 512, 4096, 4352]
    assert sdpa_bucket(1000, 0) == 1000
    for entry in ({"backend": "cudnn", "min_tokens": 2048, "bucket": 256},
                  {"backend": "cudnn", "min_tokens": 150, "bucket": 100}, {"backend": "flash", "min_tokens": 5}):
        step = entry.get("bucket", 0)
        for limit in (0, 100, 2047, 2048, 2049, 4097, 8191, 8192):
            buckets = sdpa_buckets(entry, limit)
            served = {sdpa_bucket(n, step) for n in range(entry["min_tokens"], limit + 1)}
            assert set(buckets) == served, (entry, limit)
            assert buckets == sorted(set(buckets))
            assert all(b - limit < max(step, 1) for b in buckets)  # nothing planned past the last bucket
    assert sdpa_buckets(None, 8192) == []
    assert len(sdpa_buckets({"backend": "cudnn", "min_tokens": 2048, "bucket": 256}, 8192)) == 25


def _fused_qkv(randn: Callable, tokens: int, q_heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
               fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as views of one fused qkv row (as the model passes them), or three separate tensors."""
    if fused:
        qkv = randn(tokens, q_heads + 2 * kv_heads, dim, dtype=dtype)
        return tuple(qkv.split([q_heads, kv_heads, kv_heads], dim=1))
    return tuple(randn(tokens, h, dim, dtype=dtype) for h in (q_heads, kv_heads, kv_heads))


@pytest.mark.parametrize("backend", _backends("cuda" if torch.cuda.is_available() else "cpu"))
@pytest.mark.parametrize("q_lens,bucket,fused", [([37, 70], 0, True), ([37, 70], 16, True), ([45], 0, True),
                                                  ([45], 64, True), ([45], 64, False), ([64], 64, False),
                                                  ([33, 16], 32, False)])
def test_sdpa_path_matches_ref(backend: str, q_lens: list[int], bucket: int, fused: bool, dtype: torch.dtype,
                               randn: Callable, paged_kv: Callable, check: Callable, device: str) -> None:
    """Whole prompts packed, q/k/v as views of a fused qkv row or not, each prompt padded to a multiple of
    `bucket` rows or not; K/V also in the pages for the reference."""
    from pdserve.kernels.prefill_attention import prefill_attention_sdpa

    q_heads, kv_heads, dim, block_size = 8, 2, 64, 16
    cache, tables = paged_kv(q_lens, kv_heads, dim, block_size, dtype)
    q, k, v = _fused_qkv(randn, sum(q_lens), q_heads, kv_heads, dim, dtype, fused)
    for i, n in enumerate(q_lens):  # the prompts' own K/V into their pages
        rows = slice(sum(q_lens[:i]), sum(q_lens[:i]) + n)
        for t in range(n):
            block, offset = tables[i, t // block_size].long(), t % block_size
            cache[0, block, offset], cache[1, block, offset] = k[rows][t], v[rows][t]
    cu = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    lens = torch.tensor(q_lens, dtype=torch.int32, device=device)
    try:
        out = prefill_attention_sdpa(q, k, v, tuple(q_lens), dim**-0.5, backend, bucket)
    except RuntimeError as exc:  # a backend this device / dtype / GQA does not offer
        pytest.skip(f"SDPA {backend}: {str(exc).splitlines()[0][:120]}")
    check(out, prefill_attention_ref(q, cache, cu, lens, tables, dim**-0.5), dtype)


def test_dispatcher_sends_whole_prompts_to_sdpa_by_the_table(randn: Callable, paged_kv: Callable,
                                                              monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    import importlib

    from pdserve import kernels
    from pdserve.kernels.prefill_attention import PrefillShape, prefill_attention

    dispatcher = importlib.import_module("pdserve.kernels.prefill_attention")  # the package exports the function
    used: list[str] = []
    monkeypatch.setattr(dispatcher, "sdpa_entry", lambda *args: {"backend": "math", "min_tokens": 8})
    monkeypatch.setattr(dispatcher, "prefill_attention_sdpa", lambda *args: used.append("sdpa") or args[0])
    cache, tables = paged_kv([20], 1, 16, 16, torch.float32)
    q, k = randn(20, 2, 16), randn(20, 1, 16)
    cu = torch.tensor([0, 20], dtype=torch.int32, device=device)
    lens = torch.tensor([20], dtype=torch.int32, device=device)
    kernels.set_backend("triton")
    try:
        prefill_attention(q, cache, cu, lens, tables, 0.25, k, k, PrefillShape((20,), cached=False))
        assert used == ["sdpa"]
        prefill_attention(q, cache, cu, lens, tables, 0.25, k, k, PrefillShape((20,), cached=True))
        prefill_attention(q, cache, cu, lens, tables, 0.25)  # no k, v, shape: ours
        assert used == ["sdpa"]
    finally:
        kernels.set_backend("auto")
    prefill_attention(q, cache, cu, lens, tables, 0.25, k, k, PrefillShape((20,), cached=False))
    assert used == ["sdpa"] or device == "cuda"  # off CUDA the reference, whatever the table says


def test_padded_rows_do_not_reach_the_real_ones(randn: Callable, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The padded buffer's stale memory is NaN here (torch.empty poisoned): the real rows must not see it (the
    padding is zeroed), and they equal the unpadded call's."""
    import importlib

    dispatcher = importlib.import_module("pdserve.kernels.prefill_attention")  # the package exports the function

    q, k, v = _fused_qkv(randn, 45, 4, 2, 32, torch.float32, fused=True)
    plain = dispatcher.prefill_attention_sdpa(q, k, v, (45,), 32**-0.5, "math")
    empty = torch.empty
    with monkeypatch.context() as patch:
        patch.setattr(dispatcher.torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
        padded = dispatcher.prefill_attention_sdpa(q, k, v, (45,), 32**-0.5, "math", 64)
    assert padded.shape == plain.shape and not padded.isnan().any()
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
