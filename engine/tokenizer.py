"""Tokenizer: a Hugging Face fast tokenizer (`tokenizers`) plus the model's chat template and stop tokens.

Loaded from a model directory in the Hugging Face layout (tokenizer.json, tokenizer_config.json,
chat_template.jinja, generation_config.json). GGUF tokenizers are converted into that layout once, when the
model is converted (engine/weights/convert.py). Whether BOS/EOS are added is decided by tokenizer.json's
post-processor alone: transformers 5 likewise ignores tokenizer_config's add_bos_token when tokenizer.json
exists. Deliberately imports neither torch nor transformers: the
router uses it and must start fast (the behaviour matches transformers 5's `TokenizersBackend`, which
tests/engine/test_tokenizer.py checks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as FastTokenizer

from pdserve.engine.chat import Message, render_chat

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class SpecialTokens:
    """Named special tokens as strings (what chat templates see as `bos_token`, `eos_token`, ...)."""

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None

    def as_template_vars(self) -> dict[str, str]:
        return {name: value for name in _SPECIAL_NAMES if (value := getattr(self, name)) is not None}


class Tokenizer:
    def __init__(
        self,
        backend: FastTokenizer,
        *,
        special_tokens: SpecialTokens,
        chat_template: str | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self._backend = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        ids = [self.token_to_id(special_tokens.eos_token)] if special_tokens.eos_token else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in [*ids, *eos_token_ids] if i is not None))
        self.bos_token_id: int | None = self.token_to_id(special_tokens.bos_token) if special_tokens.bos_token else None

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        """Load from a directory holding tokenizer.json (+ tokenizer_config.json, chat template files)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            files = sorted(p.name for p in path.iterdir())[:10] if path.is_dir() else "directory does not exist"
            raise FileNotFoundError(f"no tokenizer.json in {path} ({files})")
        backend = FastTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        special = SpecialTokens(**{name: _token_content(config.get(name)) for name in _SPECIAL_NAMES})
        eos = eos_token_ids + _generation_eos_ids(path)
        return cls(backend, special_tokens=special, chat_template=_read_chat_template(path, config),
                   eos_token_ids=eos)

    @property
    def backend(self) -> FastTokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; use a completion prompt instead")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_tokens.as_template_vars(), **kwargs)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: str | dict[str, Any] | None) -> str | None:
    """tokenizer_config stores a special token as a string or as a serialised AddedToken dict."""
    return value["content"] if isinstance(value, dict) else value


def _read_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """transformers 5 writes chat_template.jinja; older files keep it in tokenizer_config.json or chat_template.json."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _generation_eos_ids(path: Path) -> tuple[int, ...]:
    """generation_config.json lists every id that ends a turn (Llama 3 has three)."""
    eos = _read_json(path / "generation_config.json").get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)

