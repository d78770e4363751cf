from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.client import ApiTarget
from pdserve.bench.datasets import Conversation, LengthSpec, Turn, sample_random
from pdserve.bench.runner import LoadSpec, arrival_times, run_benchmark, turn_prompt


def test_arrivals_are_poisson_or_gamma() -> None:
    rng = np.random.default_rng(0)
    poisson = np.diff(arrival_times(20001, 10.0, 1.0, rng))
    assert abs(poisson.mean() - 0.1) < 0.005 and abs(poisson.std() / poisson.mean() - 1.0) < 0.05
    bursty = np.diff(arrival_times(20001, 10.0, 0.25, rng))  # gamma shape k: CV = 1/sqrt(k) = 2
    assert abs(bursty.mean() - 0.1) < 0.01 and abs(bursty.std() / bursty.mean() - 2.0) < 0.15
    assert (arrival_times(5, math.inf, 1.0, rng) == 0).all()
    with pytest.raises(ValueError, match="burstiness"):
        LoadSpec(burstiness=0)


def test_turn_prompts_carry_history() -> None:
    conv = Conversation((Turn("q0", 2, 4), Turn("q1", 2, 4), Turn("q2", 2, 4)))
    assert turn_prompt(conv, 0, [], chat=False) == "q0"
    assert turn_prompt(conv, 2, ["a0", "a1"], chat=False) == "q0\n\na0\n\nq1\n\na1\n\nq2"
    msgs = turn_prompt(conv, 1, ["a0"], chat=True)
    assert msgs == [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"},
                    {"role": "user", "content": "q1"}]


async def test_run_respects_rate_and_concurrency(fake_server) -> None:
    convs = sample_random(16, LengthSpec(8), LengthSpec(6), None, seed=0)
    target = ApiTarget(fake_server.url, model="fake-model")
    result = await run_benchmark(convs, target, LoadSpec(request_rate=math.inf, max_concurrency=4), progress=False)
    assert len(result.outputs) == 16 and all(o.success for o in result.outputs)
    # 4 waves of 4: each ~ ttft + 5 itl = 45 ms
    one = fake_server.ttft_s + 5 * fake_server.itl_s
    assert result.duration >= 4 * one * 0.9
    starts = sorted(o.start_time for o in result.outputs)
    assert starts[4] >= one * 0.9  # the fifth waits for a free slot


async def test_multiturn_sends_turns_in_order_with_history(fake_server) -> None:
    conv = Conversation((Turn("first question", 2, 3), Turn("second question", 2, 2)))
    n_before = len(fake_server.requests)
    target = ApiTarget(fake_server.url, "/v1/chat/completions", model="fake-model")
    result = await run_benchmark([conv], target, LoadSpec(), progress=False)
    assert [o.output_len for o in result.outputs] == [3, 2]
    assert [o.turn for o in result.outputs] == [0, 1]
    second = fake_server.requests[n_before + 1]["messages"]
    assert second[1] == {"role": "assistant", "content": " w0 w1 w2"}
    assert result.outputs[1].prompt_len == 2 + 3 + 2
    assert result.outputs[1].start_time >= result.outputs[0].start_time + result.outputs[0].latency - 1e-3
