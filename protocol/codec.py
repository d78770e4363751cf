"""Messages <-> msgpack bodies: `[kind, field, field, ...]`, every field's type checked on the way in.

    Reserve("r1", [1, 2], {...}, None, 1.7e9, 0)   ⇄   [10, "r1", [1, 2], {...}, None, 1.7e9, 0]
    Tokens([delta, ...])                         ⇄   [40, [[rid, ids, text], [rid, ids, text, finish, logprobs,
                                                        prompt, completion, cached, error], ...]]

A running request's delta travels as its three short fields; the long form only when it finishes or carries
logprobs or an error. Types are checked exactly (a bool is not an int here), so whatever a peer sends, the
receiver gets the dataclass it expects or a ProtocolError naming the field.
"""

from __future__ import annotations

from dataclasses import fields
from types import NoneType
from typing import Any

import msgpack

from pdserve.protocol.messages import (
    FINISH_CODES,
    FINISH_REASONS,
    MESSAGE_TYPES,
    Kind,
    Message,
    TokenDelta,
    Tokens,
)


class ProtocolError(Exception):
    """The peer broke the protocol: the connection is dropped."""


# annotation (as written in messages.py) -> the exact Python types msgpack may decode it to
_TYPES: dict[str, tuple[type, ...]] = {
    "bytes": (bytes,), "bytes | None": (bytes, NoneType), "str": (str,), "str | None": (str, NoneType),
    "int": (int,), "float": (float, int), "bool": (bool,), "list[int]": (list,), "dict[str, Any]": (dict,),
    "dict[str, Any] | None": (dict, NoneType), "list[dict[str, Any]] | None": (list, NoneType),
    "list[dict[str, Any] | None] | None": (list, NoneType),
}
_BY_KIND: dict[int, type[Message]] = {cls.KIND: cls for cls in MESSAGE_TYPES}
_SCHEMAS: dict[type[Message], list[tuple[str, tuple[type, ...], bool, bool]]] = {
    # (name, allowed types, is a list of ints, is a float) per field, in order
    cls: [(f.name, _TYPES[str(f.type)], str(f.type) == "list[int]", str(f.type) == "float") for f in fields(cls)]
    for cls in MESSAGE_TYPES if cls is not Tokens
}
_LONG_DELTA = 9


def encode(message: Message) -> bytes:
    if isinstance(message, Tokens):
        body: list[Any] = [Kind.TOKENS, [_delta_wire(d) for d in message.deltas]]
    else:
        body = [message.KIND, *(getattr(message, name) for name, *_ in _SCHEMAS[type(message)])]
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


def decode(raw: bytes | memoryview) -> Message:
    try:
        # every length inside is bounded by len(raw), which the framing checked before reading it
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError) as exc:  # msgpack's errors derive from ValueError
        raise ProtocolError(f"undecodable message: {exc}") from None
    if not isinstance(body, list) or not body or type(body[0]) is not int:
        raise ProtocolError(f"a message is [kind, fields...], got {type(body).__name__}")
    cls = _BY_KIND.get(body[0])
    if cls is None:
        raise ProtocolError(f"unknown message kind {body[0]}")
    if cls is Tokens:
        return _decode_tokens(body)
    schema = _SCHEMAS[cls]
    values = body[1:]
    if len(values) != len(schema):
        raise ProtocolError(f"{cls.__name__} has {len(schema)} fields, got {len(values)}")
    return cls(*(_checked(cls.__name__, spec, value) for spec, value in zip(schema, values, strict=True)))


def _checked(kind: str, spec: tuple[str, tuple[type, ...], bool, bool], value: Any) -> Any:
    name, allowed, int_list, is_float = spec
    if type(value) not in allowed:
        names = " | ".join(t.__name__ for t in allowed)
        raise ProtocolError(f"{kind}.{name} must be {names}, got {type(value).__name__}")
    if int_list and not all(type(v) is int for v in value):
        raise ProtocolError(f"{kind}.{name} must hold only ints")
    return float(value) if is_float else value


def _delta_wire(d: TokenDelta) -> list[Any]:
    if d.finish_reason is None and d.logprobs is None and d.error is None:
        return [d.request_id, d.token_ids, d.text]
    return [d.request_id, d.token_ids, d.text, FINISH_CODES[d.finish_reason], d.logprobs, d.prompt_tokens,
            d.completion_tokens, d.cached_tokens, d.error]


def _decode_tokens(body: list[Any]) -> Tokens:
    if len(body) != 2 or type(body[1]) is not list:
        raise ProtocolError("Tokens is [kind, [delta, ...]]")
    return Tokens([_delta(item) for item in body[1]])


def _delta(item: Any) -> TokenDelta:
    if type(item) is not list or len(item) not in (3, _LONG_DELTA):
        raise ProtocolError(f"a token delta has 3 or {_LONG_DELTA} fields, got {item!r:.80}")
    rid, ids, text = item[0], item[1], item[2]
    if type(rid) is not str or type(ids) is not list or type(text) is not str:
        raise ProtocolError(f"a token delta starts with (str, list, str), got {item!r:.80}")
    if not all(type(t) is int for t in ids):
        raise ProtocolError(f"token delta of {rid!r}: token ids must be ints")
    if len(item) == 3:
        return TokenDelta(rid, ids, text)
    code, logprobs, prompt, completion, cached, error = item[3:]
    if code not in FINISH_REASONS or type(code) is not int:
        raise ProtocolError(f"token delta of {rid!r}: unknown finish code {code!r}")
    if not (logprobs is None or type(logprobs) is list) or not (error is None or type(error) is str):
        raise ProtocolError(f"token delta of {rid!r}: logprobs must be a list, error a str")
    if not all(type(n) is int for n in (prompt, completion, cached)):
        raise ProtocolError(f"token delta of {rid!r}: counts must be ints")
    return TokenDelta(rid, ids, text, FINISH_REASONS[code], logprobs, prompt, completion, cached, error)
