"""SamplingParams validation and serialisation; the batched Sampler's stages, seeds and logprobs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pdserve.engine.sampling import (
    Sampler,
    SamplingParams,
    SamplingRequest,
    apply_penalties,
    apply_top_k_top_p,
    step_seed,
)

V = 50


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": 0}, r"top_k must be -1 \(off\) or in \[1, 9223372036854775807\], got 0"),
        ({"top_k": 1 << 70}, r"top_k must be -1 \(off\) or in \[1, 9223372036854775807\], got 1180591620717411303424"),
        ({"min_p": 1.2}, r"min_p must be in \[0, 1\], got 1.2"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\], got -3"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4 stop strings are allowed, got 5"),
        ({"stop": [""]}, "stop strings must not be empty"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids must be in \[0, 9223372036854775807\], got \[-1\]"),
        ({"stop_token_ids": [1 << 63]}, r"stop_token_ids must be in \[0, 9223372036854775807\], got \[9223372036854775808\]"),
        ({"seed": -(1 << 63) - 1}, r"seed must be in \[-9223372036854775808, 9223372036854775807\], got -9223372036854775809"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\], got 21"),
        ({"seed": 1.5}, r"seed must be int, got 1.5 \(float\)"),
        ({"max_tokens": "8"}, r"max_tokens must be int, got '8' \(str\)"),
        ({"temperature": True}, r"temperature must be float, got True \(bool\)"),
    ],
)
def test_invalid_values_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_round_trip_through_json() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=3, stop="x",
                            stop_token_ids=[4, 5], presence_penalty=0.5, logprobs=2)
    data = json.loads(json.dumps(params.to_dict()))
    assert data["stop"] == ["x"] and data["stop_token_ids"] == [4, 5]
    assert SamplingParams.from_dict(data) == params
    with pytest.raises(ValueError, match=r"unknown sampling parameters \['best_of'\]"):
        SamplingParams.from_dict({"best_of": 2})


def req(params: SamplingParams, output: list[int] | None = None,
        prompt: list[int] | None = None) -> SamplingRequest:
    return SamplingRequest(params, prompt or [], output or [])


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_ignores_noise() -> None:
    logits = logits_rows(4)
    out = Sampler()(logits, [req(SamplingParams(temperature=0))] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_seeded_rows_are_reproducible_alone_and_batched() -> None:
    logits = logits_rows(6, seed=1)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler()(logits[2:3], [req(seeded, output=[0] * step)]).token_ids[0] for step in range(5)]
    batched = []
    for step in range(5):
        requests = [req(SamplingParams(temperature=0.8))] * 2 + [req(seeded, output=[0] * step)]
        requests += [req(SamplingParams(temperature=0)), req(SamplingParams(seed=9))]
        requests += [req(SamplingParams(top_k=3))]
        batched.append(Sampler()(logits, requests).token_ids[2])
    assert alone == batched
    assert len(set(alone)) > 1  # the stream advances with the step


def test_step_seed_separates_seeds_and_steps() -> None:
    seeds = {step_seed(s, t) for s in range(50) for t in range(50)}
    assert len(seeds) == 2500 and all(0 <= s < 2**63 for s in seeds)


def test_sampling_follows_the_distribution() -> None:
    """Exponential race: frequencies match softmax(logits / T) (2000 draws, 4 sigma)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)])
    params = SamplingParams(temperature=0.7)
    counts = torch.zeros(V)
    sampler = Sampler()
    for _ in range(2000):
        counts[sampler(logits, [req(params)]).token_ids[0]] += 1
    expected = torch.softmax(logits[0] / 0.7, -1)[:4] * 2000
    sigma = (expected * (1 - expected / 2000)).sqrt()
    assert ((counts[:4] - expected).abs() < 4 * sigma + 1).all(), (counts[:4], expected)


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1] + [1e-9] * (V - 4)]))
    sampler = Sampler()
    cases = [(SamplingParams(top_k=2), {0, 1}), (SamplingParams(top_p=0.65), {0, 1}),
             (SamplingParams(top_p=0.05), {0}), (SamplingParams(min_p=0.6), {0, 1}),
             (SamplingParams(min_p=0.3, top_k=3), {0, 1, 2})]
    for params, allowed in cases:
        drawn = {sampler(logits, [req(params)]).token_ids[0] for _ in range(200)}
        assert drawn == allowed, params


def test_top_k_top_p_rows_are_independent() -> None:
    logits = logits_rows(3, seed=2)
    out = apply_top_k_top_p(logits, torch.tensor([V, 2, V]), torch.tensor([1.0, 1.0, 0.5]))
    assert torch.equal(out[0], logits[0])
    assert torch.isfinite(out[1]).sum() == 2 and out[1].argmax() == logits[1].argmax()
    kept = torch.isfinite(out[2])
    probs = torch.softmax(logits[2], -1)
    assert probs[kept].sum() >= 0.5 and probs[kept].sum() - probs[kept].min() < 0.5


def test_penalties_as_vllm_defines_them() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [req(params, output=[2, 2, 4], prompt=[1])])
    # token 0 unseen; 1 in the prompt: repetition only; 2 twice in output; 4 once in output
    assert out[0].tolist() == pytest.approx([2.0, -4.0, 0.5 - 1.0 - 0.25, 1.0, 0.25 - 0.5 - 0.25])
    untouched = apply_penalties(logits, [req(SamplingParams(), output=[0, 1])])
    assert untouched is logits


def test_penalties_apply_per_row_and_steer_greedy() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    greedy_penalised = SamplingParams(temperature=0, presence_penalty=1.0)
    plain = SamplingParams(temperature=0)
    out = Sampler()(logits, [req(greedy_penalised, output=[0]), req(plain, output=[0])])
    assert out.token_ids == [1, 0]


def test_logprobs_of_chosen_and_top_tokens() -> None:
    logits = logits_rows(3, seed=3)
    requests = [req(SamplingParams(temperature=0, logprobs=3)), req(SamplingParams(temperature=0)),
                req(SamplingParams(temperature=0.5, logprobs=0))]
    out = Sampler()(logits, requests)
    reference = torch.log_softmax(logits, -1)
    first = out.logprobs[0]
    assert first is not None and first.token_id == out.token_ids[0]
    assert math.isclose(first.logprob, float(reference[0].max()), abs_tol=1e-6)
    assert [t for t, _ in first.top] == reference[0].topk(3).indices.tolist()
    assert out.logprobs[1] is None
    third = out.logprobs[2]
    assert third is not None and third.top == []
    assert math.isclose(third.logprob, float(reference[2, out.token_ids[2]]), abs_tol=1e-6)


def test_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="got 2 logits rows for 1 sampling requests"):
        Sampler()(logits_rows(2), [req(SamplingParams())])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs exist only against a CUDA stream")
def test_sample_launches_without_a_host_sync_and_draws_as_on_the_cpu() -> None:
    """The overlapped decode loop calls sample() while the previous step's forward runs: a pageable list copy
    there (torch.tensor(list, device=cuda)) would make the host wait for that forward every step. Every stage
    runs here (temperature, min-p, top-k/top-p, penalties, seeds, logprobs); set_sync_debug_mode("error")
    raises on any sync until result()."""
    mixed = [req(SamplingParams(temperature=0.8, seed=1, logprobs=2)),
             req(SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=2)),
             req(SamplingParams(temperature=0.7, min_p=0.1, seed=3), output=[1, 2], prompt=[3]),
             req(SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5), output=[4], prompt=[5]),
             req(SamplingParams(temperature=1.0))]
    logits = logits_rows(len(mixed), seed=7)
    device_logits = logits.cuda()
    sampler = Sampler("cuda")
    sampler.sample(device_logits, mixed).result()  # first calls: generator and pinned-allocator setup
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = sampler.sample(device_logits, mixed)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = pending.result()
    assert out.token_ids[3] == Sampler()(logits, mixed).token_ids[3]  # greedy, penalised: the CPU's choice
    assert all(0 <= t < V for t in out.token_ids) and out.logprobs[0] is not None
    seeded = [sampler.sample(device_logits, mixed).result().token_ids[:3] for _ in range(2)]
    assert seeded[0] == seeded[1]  # seeded rows draw the same on every call
