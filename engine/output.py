"""Turning sampled tokens into client text: finish checks, incremental text, stop strings. One definition for
the decode worker (every token) and the prefill worker (the first token, so the router can send it from
whichever worker has it first and both agree to the character).

Order of checks for each new token (the same as the offline engine, so outputs match):

    the grammar (structured outputs) accepts the token; a grammar that is complete after it (it accepted EOS)
    or that rejects it (possible only past its end, with ignore_eos) ends the sequence like EOS does
    stop_token_ids / EOS (unless ignore_eos) ──▶ "stop", the token's text is not returned
    text delta ──▶ StopChecker ──▶ stop string matched ──▶ "stop", text cut before the stop string
    max_tokens reached, or prompt + output reached max_model_len ──▶ "length"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.engine.detokenizer import Decoder, IncrementalDetokenizer, StopChecker
from pdserve.engine.sampling import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.grammar import Matcher


class Generation(Protocol):
    """What the output checks read and advance: a decode request, or a prefill worker's `SequenceText`."""

    output_token_ids: list[int]
    sampling: SamplingParams
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    grammar: Matcher | None

    @property
    def num_tokens(self) -> int: ...


@dataclass
class SequenceText:
    """A sequence's output state outside the decode scheduler (a prefill worker's first token)."""

    num_prompt_tokens: int
    sampling: SamplingParams
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    output_token_ids: list[int] = field(default_factory=list)
    grammar: Matcher | None = None

    @classmethod
    def start(cls, decoder: Decoder, prompt_token_ids: list[int], sampling: SamplingParams,
              grammar: Matcher | None = None) -> SequenceText:
        return cls(len(prompt_token_ids), sampling, IncrementalDetokenizer(decoder, prompt_token_ids),
                   StopChecker(sampling.stop), grammar=grammar)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)


@dataclass(frozen=True)
class TokenResult:
    """What one appended token produced: text safe to send, and "stop" / "length" if the sequence ended."""

    text: str
    finish_reason: str | None


class NoTextDecoder:
    """For dummy weights, which come without a tokenizer: deltas carry token ids and empty text."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""


def logprobs_to_wire(entry: TokenLogprobs) -> dict[str, Any]:
    return {"token_id": entry.token_id, "logprob": entry.logprob, "top": [[t, lp] for t, lp in entry.top]}


def logprobs_from_wire(entry: dict[str, Any]) -> TokenLogprobs:
    """The inverse of `logprobs_to_wire` (the offline LLM reads its tokens' logprobs from the deltas)."""
    return TokenLogprobs(int(entry["token_id"]), float(entry["logprob"]), [(int(t), float(lp)) for t, lp in entry["top"]])


class OutputProcessor:
    """Stateless over sequences: the per-sequence detokenizer and stop checker live on the sequence."""

    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def append_token(self, seq: Generation, token_id: int) -> TokenResult:
        seq.output_token_ids.append(token_id)
        params = seq.sampling
        grammar_ended = seq.grammar is not None and (not seq.grammar.accept_token(token_id)
                                                     or seq.grammar.is_terminated())
        if (token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids)
                or grammar_ended):
            return TokenResult(self._flush(seq), "stop")
        delta = seq.detokenizer.add_token(token_id)
        released = seq.stop_checker.push(delta) if delta else None
        text = released.text if released is not None else ""
        if released is not None and released.stop is not None:
            return TokenResult(text + released.stop if params.include_stop_str_in_output else text, "stop")
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return TokenResult(text + self._flush(seq), "length")
        return TokenResult(text, None)

    @staticmethod
    def _flush(seq: Generation) -> str:
        """Held-back text at the end: an incomplete character, a partial stop-string match."""
        tail = seq.detokenizer.flush()
        if not tail:
            return seq.stop_checker.flush()
        released = seq.stop_checker.push(tail)
        return released.text if released.stop is not None else released.text + seq.stop_checker.flush()
