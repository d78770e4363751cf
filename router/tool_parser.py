"""Reading tool calls out of a model's output, whole (`parse`) or as it streams (`ToolCallStream`), for the
three ways a ToolPlan lets the model answer (router/tool_calls.py):

    auto (hermes)  text <tool_call>{"name": .., "arguments": {..}}</tool_call> ...   as vLLM's `hermes` parser
    required       [{"name": .., "parameters": {..}}, ...]                           the constrained JSON array
    named          {..}                                                             the arguments themselves

Streamed deltas are shaped as OpenAI sends them: content as {"content": text}; each call opens with
{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]} and its
arguments follow as {"tool_calls": [{"index", "function": {"arguments": text}}]}. Named calls stream their
arguments token by token; a hermes call goes out once its </tool_call> arrives, a required array at the end
(its JSON is complete only then).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.tool_calls import ToolPlan

START, END = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def wire(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse(text: str, plan: ToolPlan) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole output; output that does not parse stays content."""
    if plan.choice == "named":
        return None, [Call(plan.name or "", text)]
    if plan.choice == "required":
        calls = _required_calls(text)
        return (None, calls) if calls is not None else (text, [])
    if START not in text:
        return text, []
    parsed = [_hermes_call(a or b) for a, b in _HERMES.findall(text)]
    if any(c is None for c in parsed):
        return text, []
    content = text[: text.index(START)]
    return (content if content.strip() else None), [c for c in parsed if c is not None]


def _required_calls(text: str) -> list[Call] | None:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    return [Call(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items]


def _hermes_call(body: str) -> Call | None:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return Call(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False))


class ToolCallStream:
    """One choice's streamed deltas; `feed` each text delta, then `finish` once."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self._buffer = ""  # held text: a possible <tool_call> prefix, an open call, the required array
        self._in_call = False
        self._named_id: str | None = None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self.plan.choice == "named":
            return self._named(text)
        self._buffer += text
        return [] if self.plan.choice == "required" else self._hermes(final=False)

    def finish(self) -> list[dict[str, Any]]:
        if self.plan.choice == "named":
            return [] if self._named_id is not None else self._named("")
        if self.plan.choice == "required":
            content, calls = parse(self._buffer, self.plan)
            self._buffer = ""
            return [{"content": content}] if content else self._open_all(calls)
        return self._hermes(final=True)

    def _named(self, text: str) -> list[dict[str, Any]]:
        deltas = []
        if self._named_id is None:
            call = Call(self.plan.name or "", "")
            self._named_id = call.id
            self.num_calls = 1
            deltas.append({"tool_calls": [{"index": 0, **call.wire()}]})
        if text:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return deltas

    def _hermes(self, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while self._buffer:
            if self._in_call:
                end = self._buffer.find(END)
                if end < 0 and not final:
                    break
                body = self._buffer[:end] if end >= 0 else self._buffer
                self._buffer = self._buffer[end + len(END):] if end >= 0 else ""
                self._in_call = False
                call = _hermes_call(body)
                deltas += self._open_all([call]) if call is not None else [{"content": START + body}]
                continue
            start = self._buffer.find(START)
            if start >= 0:
                head, self._buffer, self._in_call = self._buffer[:start], self._buffer[start + len(START):], True
            else:
                keep = 0 if final else _partial_prefix(self._buffer, START)
                head, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
            if head and not (self.num_calls and not head.strip()):  # whitespace between calls is dropped
                deltas.append({"content": head})
            if start < 0:
                break
        return deltas

    def _open_all(self, calls: list[Call]) -> list[dict[str, Any]]:
        deltas = []
        for call in calls:
            index = self.num_calls
            self.num_calls += 1
            opening = {"index": index, **call.wire()}
            opening["function"] = {"name": call.name, "arguments": ""}
            deltas += [{"tool_calls": [opening]},
                       {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]
        return deltas


def _partial_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that begins `tag` (held back: it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
