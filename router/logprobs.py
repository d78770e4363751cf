"""Logprob entries from the workers ({token_id, logprob, top: [[id, logprob], ...]}, prompt entries with a
`rank` too) in the shapes clients read:

    chat            {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
    completions     {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}; with `echo`
                    the prompt's tokens come first, the first with logprob None (OpenAI's, what lm-eval reads)
    prompt_logprobs vLLM's: [None, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...], the prompt token
                    and the top-k at each position
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.router.prompts import TokenizerLike

Entry = dict[str, Any]


class LogprobFormatter:
    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tokenizer = tokenizer
        self._token_text: dict[int, str] = {}

    def text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._tokenizer.decode([token_id])
        return text

    def chat(self, entries: list[Entry]) -> dict[str, Any]:
        return {"content": [self._chat_entry(e) for e in entries], "refusal": None}

    def _chat_entry(self, entry: Entry) -> dict[str, Any]:
        token = self.text_of(entry["token_id"])
        top = [{"token": (t := self.text_of(i)), "logprob": lp, "bytes": list(t.encode())}
               for i, lp in entry.get("top") or []]
        return {"token": token, "logprob": entry["logprob"], "bytes": list(token.encode()), "top_logprobs": top}

    def legacy(self, entries: Sequence[Entry | None], text_offset: int,
               token_ids: list[int] | None = None) -> dict[str, list[Any]]:
        """Completions' shape; `token_ids` names the tokens (the prompt's under echo, whose first entry is None:
        logprob and top_logprobs None)."""
        tokens, offsets, values, tops = [], [], [], []
        for i, entry in enumerate(entries):
            token_id = token_ids[i] if token_ids is not None else entry["token_id"] if entry is not None else None
            token = self.text_of(token_id) if token_id is not None else ""
            offsets.append(text_offset)
            text_offset += len(token)
            tokens.append(token)
            values.append(None if entry is None else entry["logprob"])
            tops.append(None if entry is None else {self.text_of(i): lp for i, lp in entry.get("top") or []})
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def vllm_prompt(self, entries: list[Entry | None]) -> list[dict[str, Any] | None]:
        out: list[dict[str, Any] | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            ranked = {entry["token_id"]: (entry["logprob"], entry.get("rank", 0))}
            for rank, (token_id, lp) in enumerate(entry.get("top") or [], start=1):
                ranked.setdefault(token_id, (lp, rank))
            out.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": self.text_of(t)}
                        for t, (lp, rank) in ranked.items()})
        return out


def merge_legacy(head: dict[str, list[Any]], tail: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {key: head[key] + tail[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
