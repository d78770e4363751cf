"""From a validated OpenAI request to a `GenerationPlan`: one `SubRequest` per choice, each with its prompt
token ids and `SamplingParams`. All client-side validation lives here, in the order OpenAI applies it:
model (404), unsupported features, counts, prompt, context length, sampling values (400).
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.errors import APIError, bad_request, context_length_exceeded, model_not_found
from pdserve.router.prompts import (
    TokenizerLike,
    normalize_messages,
    normalize_prompts,
    normalize_stop,
    tokenize_chat,
    tokenize_prompt,
)
from pdserve.router.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields


@dataclass(frozen=True)
class SubRequest:
    """One independent sample: what P and D are asked to do for one choice."""

    request_id: str  # internal id, unique per sub-request
    index: int  # the choice's `index` in the response
    prompt_index: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None


@dataclass(frozen=True)
class GenerationPlan:
    id: str  # "cmpl-..." / "chatcmpl-..."
    model: str
    created: int
    chat: bool
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: no logprobs in the response
    prompt_lengths: list[int]  # per prompt (usage counts each prompt once, however large n is)
    subrequests: list[SubRequest]


async def plan_completion(req: CompletionRequest, config: RouterConfig, tokenizer: TokenizerLike) -> GenerationPlan:
    model = _check_common(req, config)
    _reject_completion_features(req)
    prompts = normalize_prompts(req.prompt)
    token_lists = [await tokenize_prompt(tokenizer, p) for p in prompts]
    max_tokens = [_max_tokens(req.max_tokens, len(ids), config, chat=False) for ids in token_lists]
    _check_totals(req.n, token_lists, max_tokens, config)
    return _build_plan(f"cmpl-{uuid.uuid4().hex}", model, req, token_lists, max_tokens, req.logprobs, chat=False)


async def plan_chat(req: ChatCompletionRequest, config: RouterConfig, tokenizer: TokenizerLike) -> GenerationPlan:
    model = _check_common(req, config)
    _reject_chat_features(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    ids = await tokenize_chat(tokenizer, normalize_messages(req.messages))
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = _max_tokens(requested, len(ids), config, chat=True, param=param)
    _check_totals(req.n, [ids], [max_tokens], config)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _build_plan(f"chatcmpl-{uuid.uuid4().hex}", model, req, [ids], [max_tokens], logprobs, chat=True)


def _check_common(req: SamplingFields, config: RouterConfig) -> str:
    model = req.model if req.model is not None else config.model
    if model not in config.served_models:
        raise model_not_found(model)
    if req.n > config.max_n:
        raise bad_request(f"'n' must be at most {config.max_n}, got {req.n}", param="n")
    if req.logit_bias:
        raise bad_request("'logit_bias' is not supported by this server", param="logit_bias")
    return model


def _reject_completion_features(req: CompletionRequest) -> None:
    if req.echo:
        raise bad_request("'echo' is not supported by this server", param="echo")
    if req.suffix:
        raise bad_request("'suffix' is not supported by this server", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"'best_of' other than n is not supported (best_of={req.best_of}, n={req.n})",
                          param="best_of")


def _reject_chat_features(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise bad_request("'tools' are not supported by this server", param="tools")
    kind = (req.response_format or {}).get("type", "text")
    if kind != "text":
        raise bad_request(f"response_format {kind!r} is not supported; only 'text'", param="response_format")


def _max_tokens(requested: int | None, prompt_len: int, config: RouterConfig, chat: bool,
                param: str = "max_tokens") -> int:
    """The completion budget; None fills the context. Raises when prompt + completion cannot fit."""
    if requested is not None and requested <= 0:
        raise APIError(400, f"Invalid '{param}': integer below minimum value. Expected a value >= 1, "
                       f"but got {requested} instead.", param=param, code="integer_below_min_value")
    completion = requested if requested is not None else max(1, config.max_model_len - prompt_len)
    if prompt_len + completion > config.max_model_len:
        raise context_length_exceeded(config.max_model_len, prompt_len, completion, chat)
    return completion


def _check_totals(n: int, token_lists: list[list[int]], max_tokens: list[int], config: RouterConfig) -> None:
    """What n multiplies: every choice is prefilled and decoded on its own, so a request costs n x its prompts'
    tokens and n x their completion budgets; each sum has its cap."""
    prompt = n * sum(len(ids) for ids in token_lists)
    if prompt > config.max_request_prompt_tokens:
        raise bad_request(f"n x prompt tokens is {n} x {prompt // n} = {prompt}, over this server's limit of "
                          f"{config.max_request_prompt_tokens} per request; lower n or shorten the prompt",
                          param="n", code="request_too_large")
    completion = n * sum(max_tokens)
    if completion > config.max_request_completion_tokens:
        raise bad_request(f"n x max_tokens is {n} x {completion // n} = {completion} completion tokens, over this "
                          f"server's limit of {config.max_request_completion_tokens} per request; lower n or "
                          f"max_tokens (unset, it fills the context)", param="n", code="request_too_large")


def _build_plan(plan_id: str, model: str, req: SamplingFields, token_lists: list[list[int]],
                max_tokens: list[int], logprobs: int | None, chat: bool) -> GenerationPlan:
    stop = normalize_stop(req.stop)
    subrequests = []
    for prompt_index, ids in enumerate(token_lists):
        for sample in range(req.n):
            index = prompt_index * req.n + sample
            seed = None if req.seed is None else req.seed + index  # n samples must differ, reproducibly
            sampling = _sampling_params(req, max_tokens[prompt_index], stop, seed, logprobs)
            subrequests.append(SubRequest(f"{plan_id}-{index}", index, prompt_index, ids, sampling, req.cache_salt))
    return GenerationPlan(plan_id, model, int(time.time()), chat, req.stream, req.include_usage, logprobs,
                          [len(ids) for ids in token_lists], subrequests)


def _sampling_params(req: SamplingFields, max_tokens: int, stop: tuple[str, ...], seed: int | None,
                     logprobs: int | None) -> SamplingParams:
    def pick(value: float | None, default: float) -> float:
        return default if value is None else value

    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick(req.temperature, 1.0),
            top_p=pick(req.top_p, 1.0),
            top_k=-1 if req.top_k in (None, 0) else req.top_k,  # 0 and -1 both mean "off" (vLLM)
            min_p=pick(req.min_p, 0.0),
            presence_penalty=pick(req.presence_penalty, 0.0),
            frequency_penalty=pick(req.frequency_penalty, 0.0),
            repetition_penalty=pick(req.repetition_penalty, 1.0),
            seed=seed,
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
    except ValueError as exc:
        raise bad_request(str(exc), param=_named_field(str(exc))) from exc


def _named_field(message: str) -> str | None:
    """The SamplingParams field a validation message is about (the longest name it mentions)."""
    words = set(re.findall(r"[a-z_]+", message))
    named = [f.name for f in dataclasses.fields(SamplingParams) if f.name in words]
    return max(named, key=len) if named else None
