"""Normalising OpenAI's union-typed inputs (prompt, messages, stop) and tokenizing them.

Every function raises `APIError` (400) naming the offending parameter, so that a client sees one clear
message instead of pydantic's one-per-union-member list.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from jinja2 import TemplateError

from pdserve.router.errors import bad_request
from pdserve.router.protocol import ChatMessage

# Tokenizing ~8k characters takes a few ms: long texts go to a thread so that other streams keep flowing.
_INLINE_TOKENIZE_CHARS = 8192


class TokenizerLike(Protocol):
    """What the router needs of engine.tokenizer.Tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    @property
    def chat_template(self) -> str | None: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str: ...


Prompt = str | list[int]


def normalize_prompts(prompt: Any) -> list[Prompt]:
    """`prompt` of /v1/completions: text, token ids, or a list of either -> one entry per choice group."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise bad_request(f"'prompt' must be a non-empty string, a list of token ids or a list of those, "
                          f"got {_preview(prompt)}", param="prompt")
    for i, item in enumerate(prompts):
        ok = (isinstance(item, str) and item) or (
            isinstance(item, list) and item and all(_is_token_id(t) for t in item))
        if not ok:
            raise bad_request(f"prompt {i} must be a non-empty string or a non-empty list of token ids, "
                              f"got {_preview(item)}", param="prompt")
    return prompts


def normalize_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages with `content` as plain text (text parts joined by newlines, as vLLM does)."""
    out = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": _message_text(i, message.content)}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:  # router/tool_calls.py renders them for the template
            entry["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def normalize_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise bad_request(f"'stop' must be a string or a list of strings, got {_preview(stop)}", param="stop")


async def tokenize(tokenizer: TokenizerLike, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) <= _INLINE_TOKENIZE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)


async def tokenize_prompt(tokenizer: TokenizerLike, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        return await tokenize(tokenizer, prompt, add_special_tokens=True)
    vocab = tokenizer.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token ids must be in [0, {vocab}), got {bad[:5]}", param="prompt")
    return list(prompt)


async def tokenize_chat(tokenizer: TokenizerLike, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        variables: dict[str, Any] | None = None) -> list[int]:
    """`variables`: extra template variables (chat_template_kwargs, tools)."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             **(variables or {}))
    except ValueError as exc:  # this tokenizer has no chat template
        raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from exc
    except TemplateError as exc:  # raise_exception() in the template, e.g. roles not alternating
        raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from exc
    # the template writes BOS itself where the model wants one (transformers tokenizes it the same way)
    return await tokenize(tokenizer, text, add_special_tokens=False)


def _message_text(index: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"only text content parts are supported, got {kind!r} in message {index}",
                                  param=f"messages.{index}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"message {index} content must be a string or a list of text parts, got {_preview(content)}",
                      param=f"messages.{index}.content")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
