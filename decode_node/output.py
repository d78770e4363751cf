"""Turning sampled tokens into stream frames: finish checks, incremental text, stop strings.

Order of checks for each new token (the same as the offline engine, so outputs match):

    stop_token_ids / EOS (unless ignore_eos) ──▶ FINISHED_STOPPED, the token's text is not returned
    text delta ──▶ StopChecker ──▶ stop string matched ──▶ FINISHED_STOPPED, text cut before the stop string
    max_tokens reached, or prompt + output reached max_model_len ──▶ FINISHED_LENGTH
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.decode_node.request import DecodeRequest, RequestState
from pdserve.engine.sampling import TokenLogprobs


@dataclass(frozen=True)
class TokenResult:
    """What one appended token produced: text safe to send, and the finished state if the request ended."""

    text: str
    finished: RequestState | None


def logprobs_to_wire(entry: TokenLogprobs | None) -> dict | None:
    if entry is None:
        return None
    return {"token_id": entry.token_id, "logprob": entry.logprob, "top": [[t, lp] for t, lp in entry.top]}


class OutputProcessor:
    """Stateless over requests: the per-request detokenizer and stop checker live on the request."""

    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def append_token(self, request: DecodeRequest, token_id: int) -> TokenResult:
        request.output_token_ids.append(token_id)
        params = request.sampling
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            return TokenResult(self._flush(request), RequestState.FINISHED_STOPPED)
        delta = request.detokenizer.add_token(token_id)
        released = request.stop_checker.push(delta) if delta else None
        text = released.text if released is not None else ""
        if released is not None and released.stop is not None:
            return TokenResult(text, RequestState.FINISHED_STOPPED)
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return TokenResult(text + self._flush(request), RequestState.FINISHED_LENGTH)
        return TokenResult(text, None)

    @staticmethod
    def _flush(request: DecodeRequest) -> str:
        """Held-back text at the end: an incomplete character, a partial stop-string match."""
        tail = request.detokenizer.flush()
        if not tail:
            return request.stop_checker.flush()
        released = request.stop_checker.push(tail)
        return released.text if released.stop is not None else released.text + request.stop_checker.flush()
