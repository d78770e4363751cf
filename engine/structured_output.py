"""What a request's output must match: a JSON schema, any JSON, a regex, one of several strings, or a grammar.

Torch- and xgrammar-free, so that the router builds it (from `response_format`, vLLM's `guided_*` and
`structured_outputs`) without loading either; the workers compile it with xgrammar (engine/grammar.py).
It crosses processes inside `SamplingParams.to_dict()` as `{"kind", "spec", "strict"}`: the grammar state
itself never travels — D rebuilds its matcher from this spec and the token ids P accepted.

    kind          spec                              from
    ────          ────                              ────
    json          the schema, JSON text             response_format json_schema, guided_json, tools
    json_object   "" (any JSON object)              response_format json_object
    regex         the pattern                       guided_regex
    choice        a JSON list of strings            guided_choice
    grammar       EBNF (GBNF) text                  guided_grammar
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20


@dataclass(frozen=True)
class StructuredOutput:
    """`strict` (json): no properties or items the schema does not name (xgrammar's strict_mode), as OpenAI's
    `strict: true`; False follows JSON Schema's own defaults (additional properties allowed)."""

    kind: str
    spec: str = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {list(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured output spec must be a string of at most {MAX_SPEC_CHARS} characters")
        if self.kind in ("regex", "grammar", "json") and not self.spec:
            raise ValueError(f"a {self.kind} structured output needs a non-empty spec")
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise ValueError(f"guided_choice must be a non-empty list of non-empty strings, got {self.spec:.80}")

    @classmethod
    def json_schema(cls, schema: Any, strict: bool = True) -> StructuredOutput:
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")  # noqa: TRY004 (a 400)
        return cls("json", json.dumps(schema), strict)  # key order kept: properties come out in it

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(choices)))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "spec": self.spec, "strict": self.strict}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutput:
        unknown = sorted(set(data) - {"kind", "spec", "strict"})
        if unknown:
            raise ValueError(f"unknown structured output fields {unknown}")
        return cls(**data)
