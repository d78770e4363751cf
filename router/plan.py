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

from pdserve.engine.sampling_params import INT64_MIN, SamplingParams
from pdserve.engine.structured_output import StructuredOutput
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
from pdserve.router.structured import structured_output
from pdserve.router.tool_calls import ToolPlan, plan_tools, render_inputs


@dataclass(frozen=True)
class SubRequest:
    """One independent sample: what P and D are asked to do for one choice."""

    request_id: str  # internal id, unique per sub-request
    index: int  # the choice's `index` in the response
    prompt_index: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None

    @property
    def needs_prefill_answer(self) -> bool:
        """Its prompt logprobs come only with P's PREFILLED: D's first delta cannot stand in for it."""
        return self.sampling.prompt_logprobs is not None


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
    echo: bool = False  # completions: the prompt's text (and, with logprobs, its tokens' logprobs) first
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs` field in the response (None: not asked)
    tools: ToolPlan | None = None  # chat: tool calls parsed from the output
    continuous_usage: bool = False  # usage in every streamed chunk (vLLM's continuous_usage_stats)


async def plan_completion(req: CompletionRequest, config: RouterConfig, tokenizer: TokenizerLike) -> GenerationPlan:
    model = _check_common(req, config)
    _reject_completion_features(req)
    if req.stream_options is not None and req.stream_options.continuous_usage_stats and not req.stream:
        raise bad_request("'stream_options' needs 'stream': true", param="stream_options")
    prompts = normalize_prompts(req.prompt)
    token_lists = [await tokenize_prompt(tokenizer, p) for p in prompts]
    max_tokens = [_max_tokens(req.max_tokens, len(ids), config, chat=False) for ids in token_lists]
    _check_totals(req.n, token_lists, max_tokens, config)
    # echo with logprobs needs the prompt's own logprobs (top-k as many as the output's), computed on P
    echoed = req.logprobs if req.echo and req.logprobs is not None else None
    wanted = [k for k in (echoed, req.prompt_logprobs) if k is not None]
    plan = _build_plan(f"cmpl-{uuid.uuid4().hex}", model, req, token_lists, max_tokens, req.logprobs, chat=False,
                       structured=structured_output(req), prompt_logprobs=max(wanted) if wanted else None)
    return dataclasses.replace(plan, echo=req.echo, prompt_logprobs=req.prompt_logprobs)


async def plan_chat(req: ChatCompletionRequest, config: RouterConfig, tokenizer: TokenizerLike) -> GenerationPlan:
    model = _check_common(req, config)
    _reject_chat_features(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    tools = plan_tools(req, config.tool_call_parser)
    structured = structured_output(req)
    if tools is not None and tools.constraint() is not None:
        if structured is not None:
            raise bad_request(f"tool_choice {tools.choice!r} constrains the output already; drop the structured-"
                              "output constraint", param="tool_choice")
        structured = tools.constraint()
    messages, variables = render_inputs(normalize_messages(req.messages), tools, tokenizer.chat_template or "")
    ids = await tokenize_chat(tokenizer, messages, req.add_generation_prompt,
                              {**(req.chat_template_kwargs or {}), **variables})
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = _max_tokens(requested, len(ids), config, chat=True, param=param)
    _check_totals(req.n, [ids], [max_tokens], config)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    plan = _build_plan(f"chatcmpl-{uuid.uuid4().hex}", model, req, [ids], [max_tokens], logprobs, chat=True,
                       structured=structured, prompt_logprobs=req.prompt_logprobs)
    return dataclasses.replace(plan, tools=tools if tools is not None and tools.parses_output else None,
                               prompt_logprobs=req.prompt_logprobs)


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
    if req.suffix:
        raise bad_request("'suffix' is not supported by this server", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"'best_of' other than n is not supported (best_of={req.best_of}, n={req.n})",
                          param="best_of")


def _reject_chat_features(req: ChatCompletionRequest) -> None:
    if req.stream_options is not None and req.stream_options.continuous_usage_stats and not req.stream:
        raise bad_request("'stream_options' needs 'stream': true", param="stream_options")


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
                max_tokens: list[int], logprobs: int | None, chat: bool, structured: StructuredOutput | None,
                prompt_logprobs: int | None) -> GenerationPlan:
    stop = normalize_stop(req.stop)
    subrequests = []
    for prompt_index, ids in enumerate(token_lists):
        for sample in range(req.n):
            index = prompt_index * req.n + sample
            # n samples must differ, reproducibly; the first takes the seed as given (SamplingParams checks its range),
            # the others wrap at the 64-bit edge
            seed = None if req.seed is None else req.seed if index == 0 else _int64(req.seed + index)
            sampling = _sampling_params(req, max_tokens[prompt_index], stop, seed, logprobs)
            sampling = dataclasses.replace(sampling, structured=structured, prompt_logprobs=prompt_logprobs,
                                           include_stop_str_in_output=req.include_stop_str_in_output)
            subrequests.append(SubRequest(f"{plan_id}-{index}", index, prompt_index, ids, sampling, req.cache_salt))
    continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
    return GenerationPlan(plan_id, model, int(time.time()), chat, req.stream, req.include_usage or continuous,
                          logprobs, [len(ids) for ids in token_lists], subrequests, continuous_usage=continuous)


def _int64(value: int) -> int:
    return (value - INT64_MIN) % (1 << 64) + INT64_MIN


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
