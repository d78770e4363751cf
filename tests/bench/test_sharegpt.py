from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from pdserve.bench.sharegpt import is_valid_pair, load_sharegpt, sample_sharegpt, sample_sharegpt_multiturn


def test_vllm_filter_rules() -> None:
    assert is_valid_pair(4, 4, False)
    assert not is_valid_pair(3, 100, False)
    assert not is_valid_pair(100, 3, False) and is_valid_pair(100, 3, True)
    assert not is_valid_pair(1025, 10, False)
    assert not is_valid_pair(1000, 1049, False) and is_valid_pair(1000, 1048, False)


def test_reads_plain_and_gzipped_files(tmp_path: Path) -> None:
    data = [{"id": "a", "conversations": [{"from": "system", "value": "be nice"},
                                          {"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello"},
                                          {"from": "human", "value": "and?"}]},
            {"id": "b", "conversations": [{"from": "gpt", "value": "orphan"}]}]
    (tmp_path / "d.json").write_text(json.dumps(data))
    with gzip.open(tmp_path / "d.json.gz", "wt") as f:
        json.dump(data, f)
    for name in ("d.json", "d.json.gz"):
        convs = load_sharegpt(tmp_path / name)
        assert [[(e.human, e.gpt) for e in c] for c in convs] == [[("hi there", "hello")], []]


def test_sharegpt_sample_uses_first_exchange_and_filters(sharegpt_path: Path, tiny_tokenizer) -> None:
    data = load_sharegpt(sharegpt_path)
    convs = sample_sharegpt(data, 100, tiny_tokenizer, seed=0)
    firsts = {c[0].human for c in data if c}
    for c in convs:
        (turn,) = c.turns
        assert turn.prompt in firsts
        assert turn.prompt_len == len(tiny_tokenizer.encode(turn.prompt, add_special_tokens=False))
        assert is_valid_pair(turn.prompt_len, turn.output_len, False)
    fixed = sample_sharegpt(data, 10, tiny_tokenizer, seed=0, output_len=7)
    assert {c.turns[0].output_len for c in fixed} == {7}
    with pytest.raises(ValueError, match="asked for 5000"):
        sample_sharegpt(data, 5000, tiny_tokenizer, seed=0)


def test_multiturn_keeps_turns_within_context(sharegpt_path: Path, tiny_tokenizer) -> None:
    convs = sample_sharegpt_multiturn(load_sharegpt(sharegpt_path), 20, tiny_tokenizer, seed=1, max_turns=3,
                                      max_context=3000)
    assert len(convs) == 20
    for c in convs:
        assert 2 <= len(c.turns) <= 3
        assert sum(t.prompt_len + t.output_len for t in c.turns) <= 3000
