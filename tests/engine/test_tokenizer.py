"""pdserve's Tokenizer against transformers' tokenizer converted from the same GGUF."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello world!",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "你好，世界！こんにちは 안녕하세요",
    "emoji 😀👍🏽🇫🇷 and combining é é",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
    "",
]

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Tell me a joke"}, {"role": "assistant", "content": "No."},
     {"role": "user", "content": "Please 🙏"}],
]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_ids_match_transformers(default_tokenizer: Tokenizer, hf_tokenizer: Any, add_special_tokens: bool) -> None:
    for text in TEXTS:
        expected = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert default_tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(default_tokenizer: Tokenizer, hf_tokenizer: Any,
                                     skip_special_tokens: bool) -> None:
    for text in TEXTS:
        ids = hf_tokenizer.encode(text)
        expected = hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert default_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(default_tokenizer: Tokenizer, hf_tokenizer: Any,
                                            add_generation_prompt: bool) -> None:
    for chat in CHATS:
        expected = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert default_tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt) == expected


def test_template_features_match_transformers(default_tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    """trim/lstrip blocks, loop controls, non-escaping tojson, special tokens as variables."""
    template = (
        "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{{ m | tojson }}|{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}GO{% endif %}"
    )
    chat = [{"role": "user", "content": "<b>&'\"é"}, {"role": "skip", "content": "x"}]
    ours = Tokenizer(default_tokenizer.backend, special_tokens=default_tokenizer.special_tokens,
                     chat_template=template)
    expected = hf_tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False,
                                                add_generation_prompt=True)
    assert ours.apply_chat_template(chat) == expected


def test_special_tokens(default_tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    assert default_tokenizer.eos_token_ids == (hf_tokenizer.eos_token_id,) == (2,)  # <|im_end|>
    assert default_tokenizer.bos_token_id == hf_tokenizer.bos_token_id == 1
    assert default_tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert default_tokenizer.convert_ids_to_tokens([2, 19556]) == hf_tokenizer.convert_ids_to_tokens([2, 19556])


def test_bos_added_by_the_post_processor_as_in_transformers(tmp_path: Path, default_model_dir: Path) -> None:
    """Llama 3 style: tokenizer.json's TemplateProcessing adds BOS (tokenizer_config's add_bos_token is ignored
    when tokenizer.json exists, in transformers 5 and here)."""
    from transformers import AutoTokenizer

    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    spec = json.loads((default_model_dir / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    ours, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text) and ours.encode(text)[0] == 1
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_generation_config_adds_eos_ids(tmp_path: Path, default_model_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.eos_token_ids == (2, 0)
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"no tokenizer.json in {tmp_path}"):
        Tokenizer.from_dir(tmp_path)
