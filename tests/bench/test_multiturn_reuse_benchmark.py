"""benchmarks/multiturn_chats.py, the part of benchmarks/multiturn_reuse.py that needs no deployment: each turn's
prompt carries the history as sent and answered, and the bound "the new turn's blocks" that a delta transfer must
stay within counts what D holds from the previous turn (its prompt and answer but the last token, full blocks)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

from pdserve.bench.sharegpt import load_sharegpt

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def chats() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("multiturn_chats")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_turn_prompts_and_the_new_turn_bound(chats: ModuleType) -> None:
    a = chats.Chat([[1, 2, 3, 4, 5], [6, 7]], [3, 2])
    b = chats.Chat([[8, 9]], [4])  # one turn: absent from turn 2's figures
    for chat in (a, b):
        chat.prompts.append(chat.prompt(0, [99]))
    a.answers.append([10, 11, 12])
    assert a.prompts[0] == [1, 2, 3, 4, 5]
    assert chats.TurnBound.of([a, b], 0, 4) == chats.TurnBound(7, 0, 2 + 1)
    a.prompts.append(a.prompt(1, [99]))
    assert a.prompts[1] == [1, 2, 3, 4, 5, 10, 11, 12, 99, 6, 7]
    # D computed KV for the prompt and the answer but its last token: 7 tokens, one full block of 4
    assert a.held_tokens(1, 4) == 4 and a.held_tokens(1, 2) == 6
    assert chats.TurnBound.of([a, b], 1, 4) == chats.TurnBound(11, 4, 3 - 1)
    assert chats.TurnBound.of([a, b], 1, 2) == chats.TurnBound(11, 6, 6 - 3)


def test_conversations_are_the_data_sets_later_turns(chats: ModuleType, sharegpt_path: Path,
                                                     tiny_tokenizer) -> None:
    picked = chats.conversations(sharegpt_path, tiny_tokenizer, 12, 0, 4, 2048, 32)
    humans = {e.human for conv in load_sharegpt(sharegpt_path) for e in conv}
    assert len(picked) == 12
    for chat in picked:
        assert 2 <= len(chat.messages) <= 4 and len(chat.max_tokens) == len(chat.messages)
        assert all(4 <= m <= 32 for m in chat.max_tokens)
        texts = [tiny_tokenizer.decode(ids) for ids in chat.messages]
        assert all(text in humans for text in texts)
