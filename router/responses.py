"""OpenAI response bodies from decode-worker frames: streaming chunks (SSE) and whole responses.

`ResponseWriter.record` is on the per-token path: it appends the frame's text to its choice and, when
streaming, `chunk_event` serialises one small JSON object around a prefix built once per request.
No tokenization happens here unless the client asked for logprobs (token strings come from the tokenizer).

Besides plain text: `echo` (completions: the prompt's text first, and its tokens' logprobs with `logprobs`),
vLLM's `prompt_logprobs` (P's, handed in per choice), tool calls (chat: parsed by router/tool_parser.py, streamed
as OpenAI's tool-call deltas), and vLLM's `continuous_usage_stats` (usage in every chunk).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.protocol.messages import TokenDelta
from pdserve.router.logprobs import LogprobFormatter, merge_legacy
from pdserve.router.plan import GenerationPlan
from pdserve.router.prompts import TokenizerLike
from pdserve.router.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
    Usage,
)
from pdserve.router.tool_parser import ToolCallStream, parse

DONE_EVENT = b"data: [DONE]\n\n"
# C; keeps non-ASCII characters as they are, as json.dumps(ensure_ascii=False) does
_json_string = json.encoder.encode_basestring
PromptEntries = list[dict[str, Any] | None]


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class ChoiceState:
    index: int
    prompt_index: int
    texts: list[str] = field(default_factory=list)
    text_length: int = 0
    num_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # frame entries, for the final body
    prompt_logprobs: PromptEntries | None = None  # P's, when asked for
    prompt_ids: list[int] = field(default_factory=list)
    tools: ToolCallStream | None = None  # chat with tools, streaming
    echoed: bool = False  # the stream sent the echoed prompt already


class ResponseWriter:
    def __init__(self, plan: GenerationPlan, tokenizer: TokenizerLike,
                 prompt_logprobs: list[PromptEntries | None] | None = None) -> None:
        self.plan = plan
        self._tokenizer = tokenizer
        self._format = LogprobFormatter(tokenizer)
        self.choices = [ChoiceState(sub.index, sub.prompt_index, prompt_ids=sub.prompt_token_ids)
                        for sub in plan.subrequests]
        for choice, entries in zip(self.choices, prompt_logprobs or [], strict=False):
            choice.prompt_logprobs = entries
        if plan.tools is not None and plan.stream:
            for choice in self.choices:
                choice.tools = ToolCallStream(plan.tools)
        kind = "chat.completion.chunk" if plan.chat else "text_completion"
        head = json.dumps({"id": plan.id, "object": kind, "created": plan.created, "model": plan.model})
        self._chunk_head = b"data: " + (head[:-1] + ',"choices":[').encode()
        self._chunk_tail = b'],"usage":null}\n\n' if plan.include_usage else b"]}\n\n"
        # a text-only chunk, the stream's common event, without json.dumps of a dict per token
        opening = '{{"index":{},"delta":{{"content":' if plan.chat else '{{"index":{},"text":'
        closing = '},"logprobs":null,"finish_reason":null}' if plan.chat else ',"logprobs":null,"finish_reason":null}'
        self._text_heads = [self._chunk_head + opening.format(c.index).encode() for c in self.choices]
        self._text_tail = closing.encode() + self._chunk_tail
        self._plain = plan.tools is None and not plan.echo and not plan.continuous_usage

    def record(self, position: int, frame: TokenDelta) -> None:
        choice = self.choices[position]
        if frame.text:
            choice.texts.append(frame.text)
        choice.num_tokens += len(frame.token_ids)
        if frame.logprobs and self.plan.logprobs is not None and not self.plan.stream:
            choice.logprobs.extend(frame.logprobs)
        if frame.finish_reason is not None:
            choice.finish_reason = frame.finish_reason
            choice.completion_tokens = frame.completion_tokens or choice.num_tokens
            choice.cached_tokens = frame.cached_tokens

    def chunk_event(self, position: int, frame: TokenDelta) -> bytes | None:
        """The SSE event(s) for one frame (None when it carries nothing a client sees)."""
        choice = self.choices[position]
        wants_logprobs = bool(frame.logprobs) and self.plan.logprobs is not None
        if self._plain and frame.finish_reason is None and not wants_logprobs:
            if not frame.text:
                return None
            choice.text_length += len(frame.text)
            return self._text_heads[position] + _json_string(frame.text).encode() + self._text_tail
        head = self._echo_event(choice) if self.plan.echo and not choice.echoed else b""
        logprobs = self._format_logprobs(frame.logprobs or [], choice.text_length) if wants_logprobs else None
        choice.text_length += len(frame.text)
        if choice.tools is not None:
            return head + self._tool_events(choice, frame, logprobs) or None
        if not frame.text and frame.finish_reason is None and logprobs is None:
            return head or None
        return head + self._event(choice, {"content": frame.text} if frame.text else {}, logprobs,
                                  frame.finish_reason)

    def _event(self, choice: ChoiceState, delta: dict[str, Any], logprobs: Any, finish: str | None) -> bytes:
        if self.plan.chat:
            body = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            body = {"index": choice.index, "text": delta.get("content", ""), "logprobs": logprobs,
                    "finish_reason": finish}
        tail = self._usage_tail() if self.plan.continuous_usage else self._chunk_tail
        return self._chunk_head + json.dumps(body, ensure_ascii=False).encode() + tail

    def _usage_tail(self) -> bytes:
        usage = self.usage(running=True).model_dump(exclude={"prompt_tokens_details"})
        return b'],"usage":' + json.dumps(usage).encode() + b"}\n\n"

    def _echo_event(self, choice: ChoiceState) -> bytes:
        """Completions with echo: the prompt's text (and logprobs) as the choice's first event."""
        choice.echoed = True
        text = self._tokenizer.decode(choice.prompt_ids)
        logprobs = self._echo_logprobs(choice) if self.plan.logprobs is not None else None
        choice.text_length += len(text)
        return self._event(choice, {"content": text}, logprobs, None)

    def _echo_logprobs(self, choice: ChoiceState) -> dict[str, Any]:
        entries = choice.prompt_logprobs or [None] * len(choice.prompt_ids)
        return self._format.legacy(entries, 0, token_ids=choice.prompt_ids)

    def _tool_events(self, choice: ChoiceState, frame: TokenDelta, logprobs: Any) -> bytes:
        assert choice.tools is not None and self.plan.tools is not None
        deltas = choice.tools.feed(frame.text)
        finish = frame.finish_reason
        if finish is not None:
            deltas += choice.tools.finish()
            finish = self.plan.tools.finish_reason(finish, choice.tools.num_calls)
        if not deltas and (finish is not None or logprobs is not None):
            deltas = [{}]
        events = [self._event(choice, d, logprobs if i == 0 else None, None) for i, d in enumerate(deltas)]
        if finish is not None:
            events.append(self._event(choice, {}, None, finish))
        return b"".join(events)

    def role_event(self) -> bytes:
        """Chat streams open with an assistant-role delta per choice, as OpenAI's do."""
        bodies = [json.dumps({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}) for c in self.choices]
        return b"".join(self._chunk_head + body.encode() + self._chunk_tail for body in bodies)

    def usage(self, running: bool = False) -> Usage:
        prompt_tokens = sum(self.plan.prompt_lengths)
        completion_tokens = sum(c.num_tokens if running else c.completion_tokens or c.num_tokens
                                for c in self.choices)
        cached: dict[int, int] = {}
        for c in self.choices:  # a prompt's n samples share its cached prefix: count it once
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.cached_tokens)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())))

    def usage_event(self) -> bytes:
        kind = "chat.completion.chunk" if self.plan.chat else "text_completion"
        return sse({"id": self.plan.id, "object": kind, "created": self.plan.created, "model": self.plan.model,
                    "choices": [], "usage": self.usage().model_dump()})

    def final_body(self) -> dict[str, Any]:
        plan, usage = self.plan, self.usage()
        if plan.chat:
            choices = [self._chat_choice(c) for c in self.choices]
            prompt = self._vllm_prompt_logprobs(self.choices[0]) if self.choices else None
            return ChatCompletionResponse(id=plan.id, created=plan.created, model=plan.model, choices=choices,
                                          usage=usage, prompt_logprobs=prompt).model_dump()
        text_choices = [self._completion_choice(c) for c in self.choices]
        return CompletionResponse(id=plan.id, created=plan.created, model=plan.model, choices=text_choices,
                                  usage=usage).model_dump()

    def _chat_choice(self, c: ChoiceState) -> ChatChoice:
        text, tools = "".join(c.texts), self.plan.tools
        if tools is None:
            return ChatChoice(index=c.index, message=AssistantMessage(content=text), logprobs=self._logprobs_of(c),
                              finish_reason=c.finish_reason)
        content, calls = parse(text, tools)
        message = AssistantMessage(content=content, tool_calls=[
            ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments)) for call in calls])
        return ChatChoice(index=c.index, message=message, logprobs=self._logprobs_of(c),
                          finish_reason=tools.finish_reason(c.finish_reason, len(calls)))

    def _completion_choice(self, c: ChoiceState) -> CompletionChoice:
        text, logprobs = "".join(c.texts), self._logprobs_of(c)
        if self.plan.echo:
            prompt_text = self._tokenizer.decode(c.prompt_ids)
            if logprobs is not None:
                logprobs = merge_legacy(self._echo_logprobs(c), self._format.legacy(c.logprobs, len(prompt_text)))
            text = prompt_text + text
        return CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                                prompt_logprobs=self._vllm_prompt_logprobs(c))

    def _vllm_prompt_logprobs(self, choice: ChoiceState) -> list[dict[str, Any] | None] | None:
        if self.plan.prompt_logprobs is None or choice.prompt_logprobs is None:
            return None
        return self._format.vllm_prompt(choice.prompt_logprobs)

    def _logprobs_of(self, choice: ChoiceState) -> dict[str, Any] | None:
        if self.plan.logprobs is None:
            return None
        return self._format_logprobs(choice.logprobs, 0)

    def _format_logprobs(self, entries: list[dict[str, Any]], text_offset: int) -> dict[str, Any]:
        if self.plan.chat:
            return self._format.chat(entries)
        return self._format.legacy(list(entries), text_offset)
