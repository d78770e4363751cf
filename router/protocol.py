"""Pydantic models of the OpenAI HTTP API (requests and non-streaming responses): the router's edge.

Fields that are unions in OpenAI's API (`prompt`, `stop`, message `content`) are typed `Any` here and
normalised in router/prompts.py, so that a bad value gets one clear message instead of one per union member.
The two request bodies keep unknown fields (`model_extra`): router/request_fields.py logs each name once, as
vLLM does, and refuses the known ones this server does not implement. Every known field's text (strings, and the
strings and keys inside lists and objects) must be encodable as UTF-8: JSON may carry a lone UTF-16 surrogate
("\\ud800"), which no tokenizer, hash or msgpack frame can take; it is refused with a 400 naming the field
(`invalid_text`, router/errors.py), before anything else looks at the request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

INVALID_TEXT = "invalid_text"  # the pydantic error type of text that cannot be encoded


def check_text(value: Any, path: str) -> None:
    """Raise `invalid_text` when a string in `value` (or a key or string nested in it) cannot be UTF-8 encoded."""
    if isinstance(value, str):
        if value.isascii():
            return
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PydanticCustomError(INVALID_TEXT, "text that cannot be encoded as UTF-8 (a lone surrogate "
                                      "U+{code} at character {at}); send valid Unicode text",
                                      {"path": path, "code": f"{ord(value[exc.start]):04X}", "at": exc.start}) from None
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if not isinstance(item, int):  # token ids: most of a long list
                check_text(item, f"{path}.{index}")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, path)
            check_text(item, f"{path}.{key}")


class _Lenient(BaseModel):
    # NaN and ±Infinity (which Python's JSON parser accepts) are refused in every float field: 400
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _encodable_text(cls, data: Any) -> Any:
        """Every known field's text, before any field is validated: the outermost model names the whole path."""
        if isinstance(data, dict):
            for name in cls.model_fields:
                if name in data:
                    check_text(data[name], name)
        return data


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk (with include_usage)


class SamplingFields(_Lenient):
    """What completions and chat completions share."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = None
    user: str | None = None
    # structured outputs (router/structured.py): OpenAI's, vLLM's older guided_* and newer structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM
    include_stop_str_in_output: bool = False  # vLLM

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    prompt: Any
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(_Lenient):
    role: str
    content: Any = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: extra variables for the chat template
    add_generation_prompt: bool = True  # vLLM


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's shape (router/logprobs.py)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM puts a chat's on the response


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
