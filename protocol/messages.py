"""Every message between router and workers, defined once (protocol/__init__.py shows who sends what, when).

Fields are plain values (str, int, float, bytes, lists, dicts of those): `sampling` is
`SamplingParams.to_dict()`, `transfer` is `TransferTarget.to_dict()`; each side builds its own types from them
and validates there. A message's `KIND` is its int tag on the wire.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

PROTOCOL_VERSION = 2  # 2: RESERVE's max_local_prefill, RESERVED's local_prefill (conditional disaggregation)


class Kind(enum.IntEnum):
    HELLO = 1
    AUTH = 2
    WELCOME = 3
    ERROR = 4
    PING = 5
    PONG = 6
    RESERVE = 10
    RESERVED = 11
    REFUSED = 12
    PREFILL = 20
    PREFILL_TARGET = 21
    PREFILLED = 22
    PREFILL_FAILED = 23
    ABORT = 30
    SENDER_LOST = 31
    TOKENS = 40


# finish reasons travel as small ints; None (still running) is 0
FINISH_CODES: dict[str | None, int] = {None: 0, "stop": 1, "length": 2, "abort": 3, "error": 4}
FINISH_REASONS: dict[int, str | None] = {code: reason for reason, code in FINISH_CODES.items()}
FAILED_FINISH = ("abort", "error")


# ---- connection ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """Acceptor -> connector, first: the challenge and who answers."""

    KIND: ClassVar[Kind] = Kind.HELLO
    nonce: bytes
    worker_id: str
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class Auth:
    """Connector -> acceptor: HMAC(secret, nonce) (None without a secret) and who is connecting."""

    KIND: ClassVar[Kind] = Kind.AUTH
    mac: bytes | None
    peer: str
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class Welcome:
    KIND: ClassVar[Kind] = Kind.WELCOME


@dataclass(frozen=True, slots=True)
class Error:
    """The connection is refused or broken (bad secret, version, a malformed frame); it closes after this."""

    KIND: ClassVar[Kind] = Kind.ERROR
    message: str


@dataclass(frozen=True, slots=True)
class Ping:
    KIND: ClassVar[Kind] = Kind.PING
    seq: int


@dataclass(frozen=True, slots=True)
class Pong:
    KIND: ClassVar[Kind] = Kind.PONG
    seq: int


# ---- decode side ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reserve:
    """Router -> D: reserve KV blocks for prompt + first token; D answers RESERVED or REFUSED.

    `max_local_prefill` > 0: D may prefill the prompt itself, with no prefill worker and no transfer, when fewer
    than that many of its tokens are missing from D's own prefix cache (conditional disaggregation; 0: never)."""

    KIND: ClassVar[Kind] = Kind.RESERVE
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    cache_salt: str | None
    arrival_time: float
    max_local_prefill: int = 0


@dataclass(frozen=True, slots=True)
class Reserved:
    """D -> router: where P pushes the KV (TransferTarget.to_dict()); `num_cached_tokens`: the leading prompt
    tokens D holds already (its prefix cache), which the target leaves out, so P sends only the rest.
    `local_prefill`: D prefills the rest itself (RESERVE's max_local_prefill allowed it); `transfer` is then {}
    and no prefill worker is asked: the first token comes in D's first delta."""

    KIND: ClassVar[Kind] = Kind.RESERVED
    request_id: str
    transfer: dict[str, Any]
    num_cached_tokens: int = 0
    local_prefill: bool = False


@dataclass(frozen=True, slots=True)
class Refused:
    """D -> router: no reservation. 400: never servable here; 409: duplicate id; 503: full, retry after."""

    KIND: ClassVar[Kind] = Kind.REFUSED
    request_id: str
    status: int
    message: str
    retry_after: float = 0.0
    param: str | None = None
    code: str | None = None


# ---- prefill side --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prefill:
    """Router -> P, sent together with RESERVE: `transfer` is None until PREFILL_TARGET brings D's target
    (P looks the prefix up meanwhile and queues the request once the target is known)."""

    KIND: ClassVar[Kind] = Kind.PREFILL
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    cache_salt: str | None
    transfer: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class PrefillTarget:
    KIND: ClassVar[Kind] = Kind.PREFILL_TARGET
    request_id: str
    transfer: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Prefilled:
    """P -> router: the first token, sampled on P, with the text and finish state D's first delta will have
    (the same output processing), so the router can send it to the client from whichever side comes first.
    `prompt_logprobs`: [None, {token_id, logprob, rank, top}, ...] over the whole prompt, when asked for
    (only P has them: the router relays P's first token for such a request, never D's)."""

    KIND: ClassVar[Kind] = Kind.PREFILLED
    request_id: str
    first_token_id: int
    text: str
    finish_reason: str | None
    logprobs: list[dict[str, Any]] | None
    num_cached_tokens: int
    num_computed_tokens: int
    prefill_s: float
    prompt_logprobs: list[dict[str, Any] | None] | None = None


@dataclass(frozen=True, slots=True)
class PrefillFailed:
    """P -> router: 400 the request cannot be served here, 499 aborted, 502 hand-off failed, 503 queue full."""

    KIND: ClassVar[Kind] = Kind.PREFILL_FAILED
    request_id: str
    status: int
    message: str
    retry_after: float = 0.0
    param: str | None = None
    code: str | None = None


# ---- both ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Abort:
    """Router -> P or D: free everything the request holds (unknown or finished ids are ignored).
    `sender_may_write`: P was given D's target, so (cuda_ipc) P's copies may still land in D's blocks: D keeps
    them until P's transfer ended; False: P never knew where to write, D frees them at once."""

    KIND: ClassVar[Kind] = Kind.ABORT
    request_id: str
    reason: str
    sender_may_write: bool = True


@dataclass(frozen=True, slots=True)
class SenderLost:
    """Router -> D: the request's prefill worker went away before its first token. A D whose transfer has no
    connection to P (`store`) learns it only so: it completes the request if its KV landed in full, else fails
    the transfer now (then recomputes or errors, per --kv-load-failure-policy). Others ignore it."""

    KIND: ClassVar[Kind] = Kind.SENDER_LOST
    request_id: str
    reason: str


@dataclass(slots=True)
class TokenDelta:
    """One request's output of one step: new token ids and the text they completed (held-back text excluded).
    The delta with a `finish_reason` is the request's last; its counts are the request's totals."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] | None = None  # one {token_id, logprob, top: [[id, lp], ...]} per token
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.finish_reason in FAILED_FINISH or self.error is not None


@dataclass(frozen=True, slots=True)
class Tokens:
    """D -> router: every request's delta of one decode step (or of one event: a first token, an abort)."""

    KIND: ClassVar[Kind] = Kind.TOKENS
    deltas: list[TokenDelta] = field(default_factory=list)


Message = (Hello | Auth | Welcome | Error | Ping | Pong | Reserve | Reserved | Refused | Prefill | PrefillTarget
           | Prefilled | PrefillFailed | Abort | SenderLost | Tokens)
MESSAGE_TYPES: tuple[type[Message], ...] = (
    Hello, Auth, Welcome, Error, Ping, Pong, Reserve, Reserved, Refused, Prefill, PrefillTarget, Prefilled,
    PrefillFailed, Abort, SenderLost, Tokens,
)
