"""vLLM's tokenizer endpoints and /version, in vLLM's request and response shapes:

    POST /tokenize    {"prompt", "add_special_tokens": true, "return_token_strs": false}
                   or {"messages", "add_generation_prompt": true, "add_special_tokens": false, "tools",
                       "chat_template_kwargs", "return_token_strs": false}   (rendered by the chat template,
                       tools as chat completions render them)
                      ─▶ {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens"} ─▶ {"prompt"}
    GET  /version     ─▶ {"version"}
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from pdserve.router.errors import bad_request, model_not_found
from pdserve.router.prompts import normalize_messages, tokenize, tokenize_chat
from pdserve.router.protocol import ChatCompletionRequest, ChatMessage
from pdserve.router.tool_calls import plan_tools, render_inputs


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def package_version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown"


def build_tokenize_router() -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        state = request.app.state.router
        _check_model(body.model, state.config.served_models)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:
            if body.add_special_tokens:  # the chat template writes the special tokens itself
                raise bad_request("'add_special_tokens': true is not supported with messages",
                                  param="add_special_tokens")
            ids = await _chat_ids(body, state.tokenizer, state.config.tool_call_parser)
        else:
            assert body.prompt is not None
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await tokenize(state.tokenizer, body.prompt, add_special_tokens=special)
        strs = [state.tokenizer.decode([t]) for t in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=state.config.max_model_len, tokens=ids,
                                token_strs=strs)

    @router.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest, request: Request) -> dict[str, str]:
        state = request.app.state.router
        _check_model(body.model, state.config.served_models)
        vocab = state.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @router.get("/version")
    async def version_route() -> dict[str, str]:
        return {"version": package_version()}

    return router


async def _chat_ids(body: TokenizeRequest, tokenizer: Any, parser: str) -> list[int]:
    assert body.messages is not None
    chat = ChatCompletionRequest(messages=body.messages, tools=body.tools)
    messages, variables = render_inputs(normalize_messages(body.messages), plan_tools(chat, parser),
                                        tokenizer.chat_template or "")
    ids = await tokenize_chat(tokenizer, messages, body.add_generation_prompt,
                              {**(body.chat_template_kwargs or {}), **variables})
    return ids


def _check_model(model: str | None, served: tuple[str, ...]) -> None:
    if model is not None and model not in served:
        raise model_not_found(model)
