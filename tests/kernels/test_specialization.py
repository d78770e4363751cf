"""kernels/specialization.py: launch keys follow Triton's own rule, the recorder sees every launch (and runs it
or not), and the launchers' keys do not depend on the batch (issue 23: no compile after start)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import specialization as spec

META = torch.device("meta")


def _values() -> list:
    f32, bf16 = torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)
    return [0, 1, 2, 16, 17, 48, -3, -16, 2**31 - 1, 2**31, 2**40, 2**63, 3.5, True, False,
            f32, f32[1:], f32[4:], bf16[8:], bf16[1:], torch.zeros(4, dtype=torch.int32),
            torch.zeros(4, dtype=torch.int64)[1:], torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.bool)]


def test_arg_key_is_tritons_own_rule() -> None:
    native = pytest.importorskip("triton._C.libtriton")
    if not hasattr(native, "native_specialize_impl"):
        pytest.skip("this Triton has no native_specialize_impl to compare with")
    from triton.backends.compiler import BaseBackend

    for value in _values():
        for specialize in (True, False):
            for align in (True, False):
                theirs = tuple(native.native_specialize_impl(BaseBackend, value, False, specialize, align))
                assert spec.arg_key(value, specialize, align) == theirs, (value, specialize, align)


def test_meta_tensors_are_aligned_by_their_offset() -> None:
    base = torch.empty(2, 7, dtype=torch.int64, device=META)
    assert spec.arg_key(base[0]) == ("*i64", "D")
    assert spec.arg_key(base[1]) == ("*i64", "")  # 7 int64 in: 56 bytes
    assert spec.arg_key(torch.empty(2, 8, dtype=torch.int64, device=META)[1]) == ("*i64", "D")


def test_do_not_specialize_removes_the_integer_classes() -> None:
    from pdserve.kernels.rms_norm_triton import _rms_norm_kernel

    def key(num_rows: int, hidden: int) -> tuple:
        x = torch.empty(4, 64, device=META)
        return spec.launch_key(_rms_norm_kernel, (x, x, x[0], x, x, x, num_rows, hidden, 64, 64, 64, 64, 1e-5),
                               {"HAS_RESIDUAL": True, "BLOCK_ROWS": 4, "BLOCK_H": 64, "QUANT": False,
                                "FP8_MAX": 448.0, "ROUND": False, "num_warps": 4})

    assert key(1, 64) == key(16, 64) == key(17, 64)  # num_rows is do_not_specialize
    assert len({key(3, 1), key(3, 16), key(3, 17)}) == 3  # hidden is not: == 1, % 16, neither


def test_recorder_runs_or_only_records_and_puts_the_kernels_back(device: str) -> None:
    from pdserve.kernels import rms_norm_triton

    kernel = rms_norm_triton._rms_norm_kernel
    x = torch.randn(5, 32, device=device)
    w = torch.randn(32, device=device)
    with spec.LaunchRecorder() as rec:
        out = rms_norm_triton.rms_norm_triton(x, w, 1e-6)
        assert rms_norm_triton._rms_norm_kernel is not kernel
    assert rms_norm_triton._rms_norm_kernel is kernel and rec.launches == 1 and len(rec.keys) == 1
    torch.testing.assert_close(out, rms_norm_triton.rms_norm_triton(x, w, 1e-6))
    with spec.LaunchRecorder(run=False) as dry:
        rms_norm_triton.rms_norm_triton(x.to(META), w.to(META), 1e-6)
    assert dry.launches == 1 and {k[0] for k in dry.keys} == {"_rms_norm_kernel"}


def _prefill_keys(batches: list[list[tuple[int, int]]], dtype: torch.dtype, on_gpu: bool,
                  monkeypatch: pytest.MonkeyPatch) -> set[tuple]:
    """Launch keys of prefill attention over batches of (q_len, cached prefix), shapes only (meta tensors)."""
    from pdserve.kernels import prefill_attention_triton as pre

    if on_gpu:  # pick tiles as on a GPU (the CPU path has one fixed config)
        choose = pre._default_config
        monkeypatch.setattr(pre, "_default_config", lambda d, t, dev, n, h: choose(d, t, torch.device("cuda"), n, h))
    cache = torch.empty(2, 4096, 16, 8, 128, dtype=dtype, device=META)
    with spec.LaunchRecorder(run=False) as rec:
        for chunks in batches:
            width = max(-(-(q + p) // 16) for q, p in chunks)
            tokens = sum(q for q, _ in chunks)
            qkv = torch.empty(tokens, 48 * 128, dtype=dtype, device=META)  # q is a view of the fused qkv rows
            q = qkv[:, : 32 * 128].view(tokens, 32, 128)
            pre.prefill_attention_triton(
                q, cache, torch.empty(len(chunks) + 1, dtype=torch.int32, device=META),
                torch.empty(len(chunks), dtype=torch.int32, device=META),
                torch.empty(len(chunks), width, dtype=torch.int32, device=META), 128**-0.5)
    return rec.keys


def _random_batches(count: int, max_tokens: int, seed: int) -> list[list[tuple[int, int]]]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        seqs = int(torch.randint(1, 257, (1,), generator=gen))
        q_lens = torch.randint(1, max(2, max_tokens // seqs), (seqs,), generator=gen).tolist()
        prefixes = (torch.randint(0, 2000, (seqs,), generator=gen) * torch.randint(0, 2, (seqs,), generator=gen))
        batches.append(list(zip(q_lens, prefixes.tolist(), strict=True)))
    return batches


@pytest.mark.parametrize("dtype,on_gpu,expected", [(torch.bfloat16, True, 2), (torch.float32, True, 1),
                                                    (torch.bfloat16, False, 1)])
def test_prefill_attention_compiles_per_tile_config_only(dtype: torch.dtype, on_gpu: bool, expected: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """200 random batches (1-256 sequences, up to 8,192 tokens, half of them after a cached prefix) and the
    single sequences 1 and 8,192 tokens reach the same keys: one per tile config."""
    ends = _prefill_keys([[(1, 0)], [(8192, 0)]], dtype, on_gpu, monkeypatch)
    served = _prefill_keys(_random_batches(200, 8192, seed=0), dtype, on_gpu, monkeypatch)
    assert len(ends) == expected and served <= ends


def test_gemv_compiles_once_per_batch_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows 1..16 of two tuned H200 shapes reach one kernel per bucket of tuning.BATCH_BUCKETS at most, and none
    where the shipped table names cuBLAS (today every bucket of 4096 -> 28672, and none of 4096 -> 14336)."""
    from pdserve.kernels import linear_triton, tuning

    monkeypatch.setattr(linear_triton, "device_name", lambda device: "NVIDIA H200")
    linear_triton.choose_config.cache_clear()
    table = tuning.default_table()
    for n in (14336, 28672):
        weight = torch.empty(n, 4096, dtype=torch.bfloat16, device=META)
        by_bucket: dict[int, set[tuple]] = {}
        for m in range(1, 17):
            with spec.LaunchRecorder(run=False) as rec:
                linear_triton.linear_triton(torch.empty(m, 4096, dtype=torch.bfloat16, device=META), weight)
            by_bucket.setdefault(tuning.batch_bucket(m), set()).update(rec.keys)
        for bucket, keys in by_bucket.items():
            entry = table.lookup("NVIDIA H200", torch.bfloat16, n, 4096, bucket)
            assert entry is not None, f"the H200 table has no entry for {n}x4096 at {bucket} rows"
            assert len(keys) <= 2  # the GEMV, and its split-K reduction if any
            assert (keys == set()) == (entry["backend"] == "torch"), (n, bucket, entry["backend"], keys)
    linear_triton.choose_config.cache_clear()


def test_compile_counter_chains_a_hook_set_before() -> None:
    triton = pytest.importorskip("triton")
    seen: list[str] = []
    before = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **k: seen.append("outer")
    try:
        with spec.CompileCounter() as counter:
            triton.knobs.runtime.jit_post_compile_hook(repr="k[num_warps=4]", fn=None)
        assert counter.compiled == ["k[num_warps=4]"] and seen == ["outer"]
        assert triton.knobs.runtime.jit_post_compile_hook is not None
    finally:
        triton.knobs.runtime.jit_post_compile_hook = before

