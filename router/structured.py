"""A request's structured-output constraint, from whichever of the API's spellings it used:

    response_format {"type": "json_object"}                        ─▶ json_object
    response_format {"type": "json_schema", "json_schema": {"schema", "strict"}} ─▶ json (strict as given)
    guided_json / guided_regex / guided_choice / guided_grammar     ─▶ json (strict) / regex / choice / grammar
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"}   (newer vLLM)

At most one may be given (400 otherwise, naming them). The spec is compiled by the workers (xgrammar), which
answer 400 when it does not compile; the router only checks its shape, without loading xgrammar.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdserve.engine.structured_output import StructuredOutput
from pdserve.router.errors import APIError, bad_request
from pdserve.router.protocol import SamplingFields

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_output(req: SamplingFields) -> StructuredOutput | None:
    found = [(param, spec) for param, spec in _candidates(req) if spec is not None]
    if len(found) > 1:
        names = ", ".join(param for param, _ in found)
        raise bad_request(f"give one structured-output constraint, got {len(found)}: {names}", param=found[1][0])
    return found[0][1] if found else None


def _candidates(req: SamplingFields) -> list[tuple[str, StructuredOutput | None]]:
    return [
        ("response_format", _response_format(req.response_format)),
        ("guided_json", _checked("guided_json", lambda: StructuredOutput.json_schema(req.guided_json))
         if req.guided_json is not None else None),
        ("guided_regex", _checked("guided_regex", lambda: StructuredOutput("regex", req.guided_regex or ""))
         if req.guided_regex is not None else None),
        ("guided_choice", _checked("guided_choice", lambda: StructuredOutput.choice(req.guided_choice or []))
         if req.guided_choice is not None else None),
        ("guided_grammar", _checked("guided_grammar", lambda: StructuredOutput("grammar", req.guided_grammar or ""))
         if req.guided_grammar is not None else None),
        ("structured_outputs", _structured_outputs(req.structured_outputs)),
    ]


def _checked(param: str, build: Callable[[], StructuredOutput]) -> StructuredOutput:
    try:
        return build()
    except (ValueError, TypeError) as exc:
        raise bad_request(f"invalid '{param}': {exc}", param=param) from exc


def _response_format(value: dict[str, Any] | None) -> StructuredOutput | None:
    kind = (value or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = (value or {}).get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("response_format json_schema needs 'json_schema': {'name', 'schema', 'strict'}",
                              param="response_format.json_schema")
        strict = spec.get("strict")
        return _checked("response_format.json_schema",
                        lambda: StructuredOutput.json_schema(spec["schema"], strict=bool(strict)))
    raise bad_request(f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'",
                      param="response_format.type")


def _structured_outputs(value: dict[str, Any] | None) -> StructuredOutput | None:
    if not value:
        return None
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_STRUCTURED_KEYS))
    if unknown:
        raise APIError(400, f"structured_outputs {unknown} are not supported; use one of {list(_STRUCTURED_KEYS)}",
                       param="structured_outputs")
    if len(given) != 1:
        raise bad_request(f"structured_outputs needs exactly one of {list(_STRUCTURED_KEYS)}, got {sorted(given)}",
                          param="structured_outputs")
    [(key, spec)] = given.items()
    param = f"structured_outputs.{key}"
    if key == "json":
        return _checked(param, lambda: StructuredOutput.json_schema(spec))
    if key == "json_object":
        return StructuredOutput("json_object")
    if key == "choice":
        return _checked(param, lambda: StructuredOutput.choice(spec))
    return _checked(param, lambda: StructuredOutput(key, spec if isinstance(spec, str) else ""))
