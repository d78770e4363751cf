from __future__ import annotations

import numpy as np
import pytest

from pdserve.planner.profile import DecodeSample, LinearFit, PrefillSample, Profile, fit_decode, fit_prefill


def _prefill_samples(rng: np.random.Generator, noise: float) -> list[PrefillSample]:
    a, b, c = 2e-5, 3e-9, 4e-3
    out = []
    for n in (16, 64, 256, 1024, 2048):
        for batch in (1, 2, 4):
            t = a * n * batch + b * n * n * batch + c
            out.append(PrefillSample((n,) * batch, t * (1 + noise * rng.standard_normal())))
    return out


def test_prefill_fit_recovers_the_coefficients() -> None:
    fit = fit_prefill(_prefill_samples(np.random.default_rng(0), 0.0))
    assert fit.coef == pytest.approx((2e-5, 3e-9, 4e-3), rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    noisy_samples = _prefill_samples(np.random.default_rng(0), 0.03)
    noisy = fit_prefill(noisy_samples)
    exact = [fit.predict(s.features()) for s in noisy_samples]
    assert [noisy.predict(s.features()) for s in noisy_samples] == pytest.approx(exact, rel=0.1)
    assert noisy.r2 > 0.99


def _decode_time(batch: int, ctxs: list[int]) -> float:
    return 1e-8 * sum(ctxs) + 2e-8 * batch * max(ctxs) + 5e-5 * batch + 0.01


def test_decode_fit_and_non_negative_coefficients() -> None:
    shapes = [[ctx] * b for b in (1, 4, 16) for ctx in (64, 512)] + [[512] + [64] * (b - 1) for b in (4, 16)]
    samples = [DecodeSample(len(c), sum(c), _decode_time(len(c), c), max(c)) for c in shapes]
    fit = fit_decode(samples)
    assert fit.coef == pytest.approx((1e-8, 2e-8, 5e-5, 0.01, 0.0), abs=1e-12)
    flat = [DecodeSample(b, b * 100, 0.02 - 1e-4 * b) for b in (1, 2, 4, 8, 16)]  # cost falls with batch: noise
    assert all(c >= 0 for c in fit_decode(flat).coef)


def test_decode_time_pads_to_the_longest_context() -> None:
    """One long sequence costs the batch·max(ctx) term for every row, as the CPU attention pads."""
    shapes = [[ctx] * b for b in (1, 4, 16) for ctx in (64, 512)] + [[512] + [64] * (b - 1) for b in (4, 16)]
    samples = [DecodeSample(len(c), sum(c), _decode_time(len(c), c), max(c)) for c in shapes]
    prof = Profile("m", "cpu", "float32", 1024, 16, fit_prefill(_prefill_samples(np.random.default_rng(0), 0.0)),
                   fit_decode(samples))
    mixed = [900] + [100] * 15
    assert prof.decode_time(16, sum(mixed), 900) == pytest.approx(_decode_time(16, mixed), rel=1e-6)
    assert prof.decode_time(16, sum(mixed)) < prof.decode_time(16, sum(mixed), 900)  # uniform: 150 each


def test_decode_fit_finds_the_step_from_one_row_to_two() -> None:
    """The CPU's one-row matmuls (GEMV) are cheaper than a line through the larger batches says: the
    multi_row term takes that step, so batch 2-4 are not priced near batch 1."""
    def step(ctxs: list[int]) -> float:
        return 1e-8 * sum(ctxs) + 2e-3 * len(ctxs) + 0.05 + (0.04 if len(ctxs) > 1 else 0.0)

    shapes = [[ctx] * b for b in (1, 2, 4, 8, 16) for ctx in (64, 256, 1024)] + [[1024] + [64] * (b - 1)
                                                                                for b in (2, 4, 8, 16)]
    samples = [DecodeSample(len(c), sum(c), step(c), max(c)) for c in shapes]
    prof = Profile("m", "cpu", "float32", 1024, 16, fit_prefill(_prefill_samples(np.random.default_rng(0), 0.0)),
                   fit_decode(samples))
    assert prof.decode_coef() == pytest.approx((1e-8, 0.0, 2e-3, 0.05, 0.04), rel=1e-6, abs=1e-12)
    assert prof.decode_time(2, 128) - prof.decode_time(1, 64) == pytest.approx(0.04 + 2e-3 + 64e-8, rel=1e-6)
    with pytest.raises(ValueError, match="one coefficient per term"):
        LinearFit(("sum_ctx", "batch"), (1.0,), 1.0)


def test_a_profile_with_the_older_three_decode_terms_still_reads() -> None:
    old = LinearFit(("sum_ctx", "batch", "const"), (1e-8, 5e-5, 0.01), 1.0)
    prof = Profile("m", "cpu", "float32", 1024, 16, old, old)
    assert prof.decode_time(4, 256, 64) == pytest.approx(1e-8 * 256 + 4 * 5e-5 + 0.01)
    assert prof.decode_coef() == (1e-8, 0.0, 5e-5, 0.01, 0.0)


def test_profile_json_round_trip(tmp_path) -> None:
    samples = _prefill_samples(np.random.default_rng(1), 0.0)
    dsamples = [DecodeSample(b, b * 64, 0.01 + 1e-4 * b) for b in (1, 2, 4, 8, 16)]
    prof = Profile("m", "cpu", "float32", 1024, 16, fit_prefill(samples), fit_decode(dsamples), samples, dsamples)
    loaded = Profile.load(prof.save(tmp_path / "p.json"))
    assert loaded == prof
    assert loaded.prefill_time([256, 256]) == pytest.approx(2 * (2e-5 * 256 + 3e-9 * 256**2) + 4e-3)
    assert loaded.prefill_time([128], [128]) > loaded.prefill_time([128])  # a chunk after a cached prefix
    assert loaded.decode_time(4, 256) == pytest.approx(0.01 + 4e-4, rel=1e-6)
    with pytest.raises(ValueError, match="at least 5 samples"):
        fit_decode(dsamples[:4])


def test_a_file_that_is_not_a_profile_is_named_by_what_is_wrong(tmp_path) -> None:
    """`pdserve plan --profile F` reports these in one line (pdserve/commands/plan.py); they were tracebacks."""
    cases = {"text": ("hello", "not JSON"), "list": ("[1, 2]", "a JSON list, not an object"),
             "object": ('{"model": "m"}', "no 'device' field"),
             "field": ('{"model": "m", "device": "cpu", "dtype": "float32", "kv_bytes_per_token": "many"}',
                       "a malformed field")}
    for name, (text, says) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=says):
            Profile.load(path)
