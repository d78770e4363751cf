"""Chat templates rendered the way Hugging Face transformers renders them.

A template is a Jinja string shipped with the tokenizer. transformers compiles it in an immutable sandbox
with `trim_blocks`, `lstrip_blocks`, the `loopcontrols` extension, a non-escaping `tojson`, and the globals
`raise_exception` / `strftime_now`, and passes the special tokens (`bos_token`, `eos_token`, ...) as
variables. Doing the same here keeps prompts byte-identical to transformers' without importing it (the
router tokenizes and must start fast); tests/engine/test_tokenizer.py compares the two.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = dict[str, Any]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters (< > &), which would change prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(
    template: str,
    messages: list[Message],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) into the prompt text."""
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
    variables = {**(special_tokens or {}), **kwargs}
    return compile_chat_template(template).render(
        messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **variables
    )
