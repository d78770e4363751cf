r"""Token ids → text deltas for streaming, and stop strings that may span token boundaries.

IncrementalDetokenizer (the prefix/read offset scheme of vLLM): a byte-level BPE token can hold part of a
UTF-8 character (one emoji is often 2-4 tokens), and SentencePiece-style decoders drop or add a leading
space depending on context. So each step decodes a short window twice:

    ids:  ... | prefix_offset ......... read_offset | new ids |
                 \__ prefix_text = decode(ids[prefix:read]) __/
                 \______________ new_text = decode(ids[prefix:]) ____________/

delta = new_text[len(prefix_text):]. While new_text ends in U+FFFD (an incomplete character) nothing is
emitted and the offsets stay, so the bytes are decoded again once the rest of the character arrives.

StopChecker: text that might be the beginning of a stop string is held back until it either completes the
stop string (the request stops; the stop string itself is never returned) or stops matching (it is released).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

_REPLACEMENT = "\ufffd"
# Tokens of prompt context decoded with the first generated tokens, so leading spaces come out right.
_PROMPT_CONTEXT = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: list[int] | tuple[int, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - _PROMPT_CONTEXT, 0)
        self.read_offset = len(self.ids)
        self.text = ""  # everything emitted so far

    def add_token(self, token_id: int) -> str:
        """Append one generated token and return the text it completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        return self._advance()

    def add_tokens(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        return self._advance()

    def _advance(self) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self._skip_special)
        new_text = decode(self.ids[self.prefix_offset:], skip_special_tokens=self._skip_special)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sequence: whatever was held back, replacement characters included."""
        prefix_text = self._tokenizer.decode(self.ids[self.prefix_offset:self.read_offset],
                                             skip_special_tokens=self._skip_special)
        new_text = self._tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=self._skip_special)
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


@dataclass(frozen=True)
class StopResult:
    text: str  # safe to send to the client now
    stop: str | None = None  # the stop string that matched; the request is finished when set


class StopChecker:
    def __init__(self, stop: list[str] | tuple[str, ...]) -> None:
        self.stop = tuple(s for s in stop if s)
        self._held = ""
        self.stopped: str | None = None

    def push(self, delta: str) -> StopResult:
        """Feed the next text delta; returns the text that can be released and whether a stop string matched."""
        if self.stopped is not None:
            raise RuntimeError(f"StopChecker already stopped on {self.stopped!r}")
        buf = self._held + delta
        match = self._earliest_match(buf)
        if match is not None:
            index, stop = match
            self._held, self.stopped = "", stop
            return StopResult(buf[:index], stop)
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep:]
        return StopResult(buf[:len(buf) - keep])

    def flush(self) -> str:
        """The sequence ended for another reason (EOS, max_tokens): release the held-back text."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, buf: str) -> tuple[int, str] | None:
        found = [(i, s) for s in self.stop if (i := buf.find(s)) >= 0]
        return min(found, key=lambda m: (m[0], -len(m[1]))) if found else None

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
