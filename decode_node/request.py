"""One decode-side request: its state, its tokens, its blocks and its output stream state.

`state` is written by `DecodeQueues.move` only (decode_node/queues.py); everything else reads it.
"""

from __future__ import annotations

import concurrent.futures
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.engine.sampling import SamplingRequest
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.grammar import Matcher


class RequestState(enum.IntEnum):
    WAITING_FOR_KV = 0  # blocks reserved, KV on its way from P
    WAITING = 1  # KV complete (first token known), waits for a slot in the running batch
    RUNNING = 2  # in the decode batch
    PREEMPTED = 3  # blocks taken back (or its KV never came); prompt + generated tokens are recomputed on D
    FINISHED_STOPPED = 4  # EOS, stop token or stop string
    FINISHED_LENGTH = 5  # max_tokens or the model's length limit
    FINISHED_ABORTED = 6  # client gone or /internal/abort
    FINISHED_ERROR = 7  # the transfer failed (P gone, KV lease ran out) or a model step failed
    # blocks reserved, D's cached prefix first; D prefills the rest itself (conditional disaggregation: no P,
    # no transfer), in the forward of the step that admits it, whose decode row samples the first token
    LOCAL_PREFILL = 8

    @property
    def finished(self) -> bool:
        return RequestState.FINISHED_STOPPED <= self <= RequestState.FINISHED_ERROR


# Which moves are legal; `DecodeQueues.move` refuses anything else.
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    # PREEMPTED from WAITING_FOR_KV: the KV never came (--kv-load-failure-policy recompute): D prefills it itself;
    # LOCAL_PREFILL: the reservation found so much of the prompt cached that D computes the rest (no transfer)
    RequestState.WAITING_FOR_KV: frozenset({RequestState.WAITING, RequestState.PREEMPTED, RequestState.LOCAL_PREFILL,
                                            RequestState.FINISHED_STOPPED, RequestState.FINISHED_LENGTH,
                                            RequestState.FINISHED_ABORTED, RequestState.FINISHED_ERROR}),
    RequestState.WAITING: frozenset({RequestState.RUNNING, RequestState.FINISHED_ABORTED,
                                     RequestState.FINISHED_ERROR}),
    RequestState.RUNNING: frozenset({RequestState.PREEMPTED, RequestState.FINISHED_STOPPED,
                                     RequestState.FINISHED_LENGTH, RequestState.FINISHED_ABORTED,
                                     RequestState.FINISHED_ERROR}),
    RequestState.PREEMPTED: frozenset({RequestState.RUNNING, RequestState.FINISHED_ABORTED,
                                       RequestState.FINISHED_ERROR}),
    RequestState.LOCAL_PREFILL: frozenset({RequestState.RUNNING, RequestState.FINISHED_ABORTED,
                                           RequestState.FINISHED_ERROR}),
}

FINISH_REASONS: dict[RequestState, str] = {
    RequestState.FINISHED_STOPPED: "stop",
    RequestState.FINISHED_LENGTH: "length",
    RequestState.FINISHED_ABORTED: "abort",
    RequestState.FINISHED_ERROR: "error",
}


@dataclass
class DecodeRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # full prompt blocks (the reservation's prefix lookup)
    arrival_time: float = field(default_factory=time.time)
    state: RequestState = RequestState.WAITING_FOR_KV
    block_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V sit in block_ids
    num_pending: int = 0  # tokens sampled by launched steps whose ids the host has not read yet (0 or 1)
    held_by_sender: bool = False  # aborted while P may still write its blocks (cuda_ipc): freed once it cannot
    cached_tokens: int = 0  # leading prompt tokens found in this worker's prefix cache at reserve (not sent by P)
    num_preemptions: int = 0
    error: str | None = None
    abort_requested: bool = False
    grammar: Matcher | None = None  # structured outputs: rebuilt here from the spec, P's first token accepted
    # the worker's first constrained requests: the matcher while xgrammar loads (decode_node/node.py), and why
    # it could not be built
    grammar_loading: concurrent.futures.Future[Matcher] | None = None
    grammar_error: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.state)

    @property
    def needs_history(self) -> bool:
        """Its sampling reads every token generated so far (penalties): no step may run ahead of the host."""
        p = self.sampling
        return p.repetition_penalty != 1 or bool(p.presence_penalty) or bool(p.frequency_penalty)

    def sampling_request(self) -> SamplingRequest:
        """Called once the step that samples for it is scheduled (`num_pending` counts that step already)."""
        return SamplingRequest(self.sampling, self.prompt_token_ids, self.output_token_ids, self.num_pending - 1,
                               self.grammar)
