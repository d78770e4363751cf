"""What one decode step plans and produces: the scheduler's typed results (decode_node/scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.decode_node.request import DecodeRequest
from pdserve.engine.output import logprobs_to_wire
from pdserve.engine.sampling import TokenLogprobs
from pdserve.protocol.messages import TokenDelta


@dataclass(frozen=True)
class Refusal:
    """Why a reservation was refused; `retry_after` seconds is a hint for the router."""

    message: str
    retry_after: float
    status: int = 503


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    delta: TokenDelta

    @classmethod
    def of(cls, request: DecodeRequest, token_ids: list[int], text: str,
           logprobs: TokenLogprobs | None = None) -> RequestOutput:
        """The request's next frame: `token_ids` and `text` new since the last one, its finish reason and counts.
        `logprobs`: the one new token's, when the request asked and the step computed them."""
        wire = None
        if request.sampling.logprobs is not None and logprobs is not None:
            wire = [logprobs_to_wire(logprobs)]
        delta = TokenDelta(request.request_id, token_ids, text, request.finish_reason, wire,
                           len(request.prompt_token_ids), len(request.output_token_ids), request.cached_tokens,
                           request.error)
        return cls(request.request_id, delta)


@dataclass(frozen=True)
class RecomputeItem:
    """Tokens to prefill on D before the step's decode rows, from position `start`: a preempted request's
    tokens but the last, again, into fresh blocks (start 0); or, `local` (conditional disaggregation), the prompt
    after D's cached prefix but its last token, whose decode row then samples the first token."""

    request: DecodeRequest
    token_ids: list[int]
    block_ids: list[int]
    start: int = 0
    local: bool = False


@dataclass(frozen=True)
class DecodeItem:
    """One row of a decode step: feed `token_id` at `position`, K/V written into `block_ids`. `source_row`
    >= 0: the token is what the step in flight samples in that row (still on the device)."""

    request: DecodeRequest
    token_id: int
    position: int
    block_ids: list[int]
    source_row: int = -1


@dataclass
class DecodeBatch:
    recompute: list[RecomputeItem] = field(default_factory=list)
    decode: list[DecodeItem] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)  # deltas produced while scheduling
    needs_drain: bool = False  # nothing scheduled: complete the step in flight first, then schedule again

    @property
    def empty(self) -> bool:
        return not self.decode
