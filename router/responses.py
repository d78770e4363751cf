"""OpenAI response bodies from decode-worker frames: streaming chunks (SSE) and whole responses.

`ResponseWriter.record` is on the per-token path: it appends the frame's text to its choice and, when
streaming, `chunk_event` serialises one small JSON object around a prefix built once per request.
No tokenization happens here unless the client asked for logprobs (token strings come from the tokenizer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.protocol.messages import TokenDelta
from pdserve.router.plan import GenerationPlan
from pdserve.router.prompts import TokenizerLike
from pdserve.router.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)

DONE_EVENT = b"data: [DONE]\n\n"
# C; keeps non-ASCII characters as they are, as json.dumps(ensure_ascii=False) does
_json_string = json.encoder.encode_basestring  # type: ignore[attr-defined]


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


class ResponseWriter:
    def __init__(self, plan: GenerationPlan, tokenizer: TokenizerLike) -> None:
        self.plan = plan
        self._tokenizer = tokenizer
        self._token_text: dict[int, str] = {}
        self.choices = [ChoiceState(sub.index, sub.prompt_index) for sub in plan.subrequests]
        kind = "chat.completion.chunk" if plan.chat else "text_completion"
        head = json.dumps({"id": plan.id, "object": kind, "created": plan.created, "model": plan.model})
        self._chunk_head = b"data: " + (head[:-1] + ',"choices":[').encode()
        self._chunk_tail = b'],"usage":null}\n\n' if plan.include_usage else b"]}\n\n"
        # a text-only chunk, the stream's common event, without json.dumps of a dict per token
        opening = '{{"index":{},"delta":{{"content":' if plan.chat else '{{"index":{},"text":'
        closing = '},"logprobs":null,"finish_reason":null}' if plan.chat else ',"logprobs":null,"finish_reason":null}'
        self._text_heads = [self._chunk_head + opening.format(c.index).encode() for c in self.choices]
        self._text_tail = closing.encode() + self._chunk_tail

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
        """The SSE event for one frame (None when it carries nothing a client sees)."""
        choice = self.choices[position]
        if frame.finish_reason is None and not (frame.logprobs and self.plan.logprobs is not None):
            if not frame.text:
                return None
            choice.text_length += len(frame.text)
            return self._text_heads[position] + _json_string(frame.text).encode() + self._text_tail
        logprobs = None
        if frame.logprobs and self.plan.logprobs is not None:
            logprobs = self._format_logprobs(frame.logprobs, choice.text_length)
        choice.text_length += len(frame.text)
        if not frame.text and frame.finish_reason is None and logprobs is None:
            return None
        if self.plan.chat:
            delta = {"content": frame.text} if frame.text else {}
            body = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": frame.finish_reason}
        else:
            body = {"index": choice.index, "text": frame.text, "logprobs": logprobs,
                    "finish_reason": frame.finish_reason}
        return self._chunk_head + json.dumps(body, ensure_ascii=False).encode() + self._chunk_tail

    def role_event(self) -> bytes:
        """Chat streams open with an assistant-role delta per choice, as OpenAI's do."""
        bodies = [json.dumps({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}) for c in self.choices]
        return b"".join(self._chunk_head + body.encode() + self._chunk_tail for body in bodies)

    def usage(self) -> Usage:
        prompt_tokens = sum(self.plan.prompt_lengths)
        completion_tokens = sum(c.completion_tokens or c.num_tokens for c in self.choices)
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
            choices = [ChatChoice(index=c.index, message=AssistantMessage(content="".join(c.texts)),
                                  logprobs=self._logprobs_of(c), finish_reason=c.finish_reason)
                       for c in self.choices]
            return ChatCompletionResponse(id=plan.id, created=plan.created, model=plan.model, choices=choices,
                                          usage=usage).model_dump()
        text_choices = [CompletionChoice(index=c.index, text="".join(c.texts), logprobs=self._logprobs_of(c),
                                         finish_reason=c.finish_reason) for c in self.choices]
        return CompletionResponse(id=plan.id, created=plan.created, model=plan.model, choices=text_choices,
                                  usage=usage).model_dump()

    def _logprobs_of(self, choice: ChoiceState) -> dict[str, Any] | None:
        if self.plan.logprobs is None:
            return None
        return self._format_logprobs(choice.logprobs, 0)

    def _format_logprobs(self, entries: list[dict[str, Any]], text_offset: int) -> dict[str, Any]:
        """Frame entries {token_id, logprob, top: [[id, logprob], ...]} in OpenAI's chat or legacy shape."""
        if self.plan.chat:
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        tokens, offsets = [], []
        for entry in entries:
            token = self._text_of(entry["token_id"])
            offsets.append(text_offset)
            text_offset += len(token)
            tokens.append(token)
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{self._text_of(i): lp for i, lp in e.get("top") or []} for e in entries],
                "text_offset": offsets}

    def _chat_entry(self, entry: dict[str, Any]) -> dict[str, Any]:
        token = self._text_of(entry["token_id"])
        top = [{"token": (t := self._text_of(i)), "logprob": lp, "bytes": list(t.encode())}
               for i, lp in entry.get("top") or []]
        return {"token": token, "logprob": entry["logprob"], "bytes": list(token.encode()), "top_logprobs": top}

    def _text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._tokenizer.decode([token_id])
        return text
