"""Per-request sampling parameters, validated on construction; JSON-able for crossing processes.

Kept free of torch so the router (which validates requests but never touches tensors) imports it cheaply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pdserve.engine.structured_output import StructuredOutput

MAX_STOP_STRINGS = 4  # OpenAI's documented limit ("up to 4 sequences")
# OpenAI documents no length: 256 characters holds any stop marker in use ("\n\nUser:", "</answer>", ...) and
# bounds what a request copies into each of its n sub-requests and what D compares every step (a 100 kB stop
# string was accepted and copied n x 2 times before)
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20
# integers every process's messages carry (msgpack: 64 bits); seed's range is vLLM's (torch.long)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_GREEDY_EPS = 1e-5  # temperatures below this are greedy (as in vLLM): dividing by them overflows


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. JSON-able through to_dict/from_dict.

    logprobs: None for none; k >= 0 for the chosen token's logprob plus the k likeliest tokens' (as in vLLM).
    prompt_logprobs: None for none; k >= 0 for every prompt token's logprob (but the first's) plus the k
        likeliest at that position, computed by the prefill worker over the whole prompt (no cached prefix).
    structured: what the output must match (engine/structured_output.py); None: free text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    include_stop_str_in_output: bool = False  # a matched stop string ends the text instead of being cut (vLLM)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop, str))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids, int))
        _check_type("max_tokens", self.max_tokens, int)
        _check_type("top_k", self.top_k, int)
        _check_type("ignore_eos", self.ignore_eos, bool)
        _check_type("include_stop_str_in_output", self.include_stop_str_in_output, bool)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _check_type(name, getattr(self, name), float)
        if self.seed is not None:
            _check_type("seed", self.seed, int)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_type(name, getattr(self, name), int)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        self._check_ranges()

    def _check_ranges(self) -> None:
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or 1 <= self.top_k <= INT64_MAX,
             f"top_k must be -1 (off) or in [1, {INT64_MAX}], got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (len(self.stop) <= MAX_STOP_STRINGS,
             f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}"),
            (all(self.stop), f"stop strings must not be empty, got {list(self.stop)}"),
            (all(len(s) <= MAX_STOP_CHARS for s in self.stop),
             f"stop strings must be at most {MAX_STOP_CHARS} characters each, got {max(map(len, self.stop), default=0)}"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
             f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}"),
            (all(0 <= t <= INT64_MAX for t in self.stop_token_ids),
             f"stop_token_ids must be in [0, {INT64_MAX}], got {list(self.stop_token_ids)}"),
            (self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
             f"seed must be in [{INT64_MIN}, {INT64_MAX}], got {self.seed}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["structured"] = None if self.structured is None else self.structured.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameters {unknown}; known: {sorted(known)}")
        structured = data.get("structured")
        if isinstance(structured, dict):
            data = {**data, "structured": StructuredOutput.from_dict(structured)}
        return cls(**data)


def _check_type(name: str, value: Any, kind: type) -> None:
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ValueError(f"{name} must be {kind.__name__}, got {value!r} ({type(value).__name__})")


def _as_tuple(name: str, value: Any, kind: type) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, int)):
        value = [value]
    items = tuple(value)
    for item in items:
        _check_type(name, item, kind)
    return items
