from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.datasets import LengthSpec, sample_random, sample_random_multiturn


def test_uniform_lengths_follow_range_ratio() -> None:
    lens = LengthSpec(100, 0.5).sample(np.random.default_rng(0), 5000)
    assert lens.min() >= 50 and lens.max() <= 150
    assert abs(lens.mean() - 100) < 2
    assert (LengthSpec(64).sample(np.random.default_rng(0), 10) == 64).all()


def test_normal_lengths_have_mean_and_std() -> None:
    lens = LengthSpec(200, 0.1, "normal").sample(np.random.default_rng(1), 20000)
    assert abs(lens.mean() - 200) < 1 and abs(lens.std() - 20) < 1
    with pytest.raises(ValueError, match="range-ratio"):
        LengthSpec(10, 1.5)


def test_random_prompts_without_tokenizer_are_token_ids_of_exact_length() -> None:
    convs = sample_random(20, LengthSpec(32, 0.25), LengthSpec(8), None, seed=3)
    for c in convs:
        (turn,) = c.turns
        assert isinstance(turn.prompt, list) and len(turn.prompt) == turn.prompt_len
        assert 24 <= turn.prompt_len <= 40 and turn.output_len == 8
    again = sample_random(20, LengthSpec(32, 0.25), LengthSpec(8), None, seed=3)
    assert [c.turns[0].prompt for c in convs] == [c.turns[0].prompt for c in again]


def test_random_text_prompts_have_the_asked_token_count(tiny_tokenizer) -> None:
    convs = sample_random(10, LengthSpec(50), LengthSpec(4), tiny_tokenizer, seed=0)
    counts = [len(tiny_tokenizer.encode(c.turns[0].prompt, add_special_tokens=False)) for c in convs]
    assert counts == [c.turns[0].prompt_len for c in convs]
    assert all(abs(n - 50) <= 2 for n in counts)


def test_prefix_groups_share_their_prefix() -> None:
    convs = sample_random(12, LengthSpec(10), LengthSpec(4), None, seed=0, prefix_len=16, num_prefix_groups=3)
    prefixes = {tuple(c.turns[0].prompt[:16]) for c in convs}
    assert len(prefixes) == 3
    assert all(c.turns[0].prompt_len == 26 for c in convs)


def test_random_multiturn_has_the_turns(tiny_tokenizer) -> None:
    convs = sample_random_multiturn(3, 4, LengthSpec(12), LengthSpec(5), tiny_tokenizer, seed=0)
    assert [len(c.turns) for c in convs] == [4, 4, 4]
    assert all(isinstance(t.prompt, str) for c in convs for t in c.turns)
