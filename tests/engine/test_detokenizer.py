"""Streaming detokenization on SmolLM2's byte-level BPE, and stop strings across token boundaries."""

from __future__ import annotations

import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.engine.tokenizer import Tokenizer

STREAMED = [
    "😀👍🏽🇫🇷 emoji split over several byte-level tokens",
    "漢字とかなの混じった文、그리고 한국어",
    " leading space, then ünïcödé and a 🐍",
    "plain ascii text, nothing special",
]


def _stream(tokenizer: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt or [])
    deltas = [detok.add_token(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", STREAMED)
def test_deltas_concatenate_to_the_full_decode(default_tokenizer: Tokenizer, text: str) -> None:
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(default_tokenizer, ids)
    assert "".join(deltas) == default_tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_partial_characters_are_held_back(default_tokenizer: Tokenizer) -> None:
    ids = default_tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # one emoji, several tokens: the test means something
    deltas = _stream(default_tokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "😀" and deltas[-1] == ""


def test_prompt_context_and_special_tokens(default_tokenizer: Tokenizer) -> None:
    prompt = default_tokenizer.encode("<|im_start|>assistant\n")
    answer = default_tokenizer.encode(" Sure, 你好!", add_special_tokens=False)
    eos = default_tokenizer.eos_token_ids[0]
    deltas = _stream(default_tokenizer, answer + [eos], prompt)
    assert "".join(deltas) == " Sure, 你好!"  # prompt not repeated, <|im_end|> skipped


def test_incomplete_character_at_the_end_is_flushed(default_tokenizer: Tokenizer) -> None:
    ids = default_tokenizer.encode("a😀", add_special_tokens=False)[:-1]
    deltas = _stream(default_tokenizer, ids)
    assert deltas[0] == "a" and "".join(deltas[1:-1]) == "" and deltas[-1].startswith("\ufffd")


def _push_all(checker: StopChecker, deltas: list[str]) -> tuple[str, str | None]:
    out = []
    for delta in deltas:
        result = checker.push(delta)
        out.append(result.text)
        if result.stop is not None:
            return "".join(out), result.stop
    out.append(checker.flush())
    return "".join(out), None


def test_stop_string_across_deltas_is_not_returned() -> None:
    checker = StopChecker(["###"])
    results = [checker.push(d) for d in ["Hello #", "#", " not yet", " end#", "##tail"]]
    assert [r.text for r in results] == ["Hello ", "", "## not yet", " end", ""]
    assert results[-1].stop == "###" and checker.stopped == "###"
    with pytest.raises(RuntimeError, match="already stopped"):
        checker.push("more")


def test_earliest_stop_wins_and_partial_matches_are_released() -> None:
    assert _push_all(StopChecker(["world", "lo w"]), ["hel", "lo wor", "ld"]) == ("hel", "lo w")
    assert _push_all(StopChecker(["abcd"]), ["xab", "cx", "y"]) == ("xabcxy", None)
    assert _push_all(StopChecker([]), ["a", "b"]) == ("ab", None)
    assert _push_all(StopChecker(["\n\n"]), ["line\n", "\nnext"]) == ("line", "\n\n")


def test_stop_string_on_real_tokens(default_tokenizer: Tokenizer) -> None:
    text = "The answer is 42.\nObservation: done"
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    detok, checker = IncrementalDetokenizer(default_tokenizer), StopChecker(["Observation:"])
    out, stop = "", None
    for i in ids:
        result = checker.push(detok.add_token(i))
        out += result.text
        if result.stop:
            stop = result.stop
            break
    assert (out, stop) == ("The answer is 42.\n", "Observation:")
