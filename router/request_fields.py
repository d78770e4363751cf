"""Request fields the router does not read: known ones it does not implement are refused (400, named), any
other unknown field is logged once per name for the router's life, as vLLM does ("The following fields were
present in the request but ignored: ...").

Implemented elsewhere, for reference: response_format, guided_json / regex / choice / grammar,
structured_outputs (router/structured.py); tools, tool_choice, parallel_tool_calls (router/tool_calls.py);
echo, prompt_logprobs, include_stop_str_in_output, stream_options.continuous_usage_stats, chat_template_kwargs,
add_generation_prompt (router/plan.py, router/responses.py).
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from pdserve.router.errors import bad_request

log = logging.getLogger(__name__)

# vLLM / OpenAI parameters that would change the output if honoured; value: the one that means "off" (accepted)
UNSUPPORTED: dict[str, Any] = {
    "min_tokens": 0, "use_beam_search": False, "length_penalty": 1.0, "truncate_prompt_tokens": None,
    "allowed_token_ids": None, "bad_words": None, "logits_processors": None, "prompt_embeds": None,
    "guided_decoding_backend": None, "guided_whitespace_pattern": None, "structural_tag": None,
    "continue_final_message": False, "documents": None, "return_tokens_as_token_ids": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "add_special_tokens": None,
    "mm_processor_kwargs": None, "reasoning_effort": None, "functions": None, "function_call": None,
    "audio": None, "modalities": None, "prediction": None, "min_p_tokens": None, "vllm_xargs": None,
}


class FieldLog:
    """The unknown field names seen so far (one log line each); lives in the router's state."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def check(self, body: BaseModel) -> None:
        extra = body.model_extra or {}
        for name, value in extra.items():
            if name in UNSUPPORTED and value != UNSUPPORTED[name] and value is not None:
                raise bad_request(f"'{name}' is not supported by this server (got {value!r:.60})", param=name)
        unknown = sorted(n for n in extra if n not in UNSUPPORTED and n not in self.seen)
        if unknown:
            self.seen.update(unknown)
            log.warning("The following fields were present in the request but ignored: %s", unknown)
