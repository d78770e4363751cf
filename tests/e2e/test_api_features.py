"""Issue 17 through real `pdserve serve` deployments (disaggregated and colocated) and the official `openai`
client: first-token top logprobs equal across paths and to the offline engine's, structured outputs validated
with `jsonschema`, tool calls whose arguments validate against their schemas, echo log-likelihoods equal to the
offline engine's (fp32 CPU, 1e-4), /tokenize, /detokenize, /version and refused parameters."""

from __future__ import annotations

import json
from operator import itemgetter
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch

from pdserve.engine.sampling import SamplingParams
from pdserve.engine.structured_output import StructuredOutput
from tests.e2e.deployments import MODEL, Deployment

PROMPT = "The capital of France is"
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time of a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
# ~1,300 tokens: longer than the deployments' --max-num-batched-tokens 1024, so P computes it in two chunks
# ~590 tokens: prompt logprobs in three 256-row slices (engine/prompt_logprobs.py)
LONG = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(40))


def client(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0, timeout=300)


_OFFLINE: dict[str, object] = {}  # repr of (prompt, params, chat) -> the offline engine's output


def offline(llm, prompt: list[int] | str, params: SamplingParams, chat: bool = False):
    """The offline engine's output, computed once per module: it is the same for both deployments (greedy, or
    seeded), and the echo test's is a 1,300-token forward with prompt logprobs on one thread."""
    key = repr((prompt, params, chat))
    if key not in _OFFLINE:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _OFFLINE[key] = llm.generate([prompt], params, use_chat=chat)[0]
        finally:
            torch.set_num_threads(threads)
    return _OFFLINE[key]


# ---- 1. first-token top logprobs ------------------------------------------------------------------


def test_first_token_top_logprobs_equal_offline_on_every_path(deployment: Deployment, offline_llm) -> None:
    expected = offline(offline_llm, PROMPT, SamplingParams(max_tokens=3, temperature=0, logprobs=3)).logprobs
    first = expected[0]
    api = client(deployment)
    replies = [api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=3)
               for _ in range(2)]  # the second finds the prompt's blocks in P's prefix cache
    streamed = list(api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=3,
                                           stream=True))
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=1,
                                       temperature=0, logprobs=True, top_logprobs=3)
    tokenizer = offline_llm.tokenizer
    want = {tokenizer.decode([t]): lp for t, lp in first.top}
    for reply in replies:
        lp = reply.choices[0].logprobs
        assert lp.top_logprobs[0], "the first token's top_logprobs are empty"
        assert lp.top_logprobs[0].keys() == want.keys()
        assert all(abs(lp.top_logprobs[0][k] - v) < 1e-4 for k, v in want.items())
        assert [abs(a - b.logprob) < 1e-4 for a, b in zip(lp.token_logprobs, expected, strict=True)] == [True] * 3
    stream_first = next(c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs)
    assert stream_first.top_logprobs[0].keys() == want.keys()
    assert stream_first.top_logprobs[0] == replies[0].choices[0].logprobs.top_logprobs[0]
    assert chat.choices[0].logprobs.content[0].top_logprobs, "chat: the first token's top_logprobs are empty"


# ---- 2. structured outputs ------------------------------------------------------------------------


def test_json_schema_output_validates_and_equals_offline(deployment: Deployment, offline_llm) -> None:
    messages = [{"role": "user", "content": "Describe a person living in Europe as JSON."}]
    reply = client(deployment).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    expected = offline(offline_llm, messages[0]["content"], SamplingParams(
        max_tokens=60, temperature=0, structured=StructuredOutput.json_schema(PERSON)), chat=True)
    assert text == expected.text  # P masked the first token, D continued from the same matcher state


def test_guided_fields_and_json_object(deployment: Deployment) -> None:
    api = client(deployment)
    choice = api.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
                                    extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.choices[0].text in ("yes", "no", "maybe")
    regex = api.completions.create(model=MODEL, prompt="A phone number:", max_tokens=20, temperature=0,
                                   extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert len(regex.choices[0].text) == 8 and regex.choices[0].text[3] == "-"
    newer = api.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=60, temperature=0,
                                   extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(newer.choices[0].text), PERSON)
    obj = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Any JSON object."}],
                                      max_tokens=100, temperature=0, response_format={"type": "json_object"})
    text = obj.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":  # else max_tokens cut it (a long string value): a JSON prefix
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")
    grammar = api.completions.create(model=MODEL, prompt="Count:", max_tokens=10, temperature=0,
                                     extra_body={"guided_grammar": 'root ::= "one" | "two"'})
    assert grammar.choices[0].text in ("one", "two")


# ---- 3. tool calls -------------------------------------------------------------------------------


def test_required_and_named_tool_calls_validate(deployment: Deployment) -> None:
    api = client(deployment)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    required = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                           tool_choice="required", max_tokens=80, temperature=0)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    named = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=60,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        temperature=0)
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    stream = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=60,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_weather"
    assert "".join(tc.function.arguments or "" for tc in calls) == call.function.arguments


def test_tool_messages_in_history(deployment: Deployment) -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees and snowing"}]
    reply = client(deployment).chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                       max_tokens=20, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokens = httpx.post(f"{deployment.url}/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()
    rendered = httpx.post(f"{deployment.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "-3 degrees and snowing" in rendered and '"city": "Oslo"' in rendered and "<tools>" in rendered
    assert tokens["count"] == reply.usage.prompt_tokens


# ---- 4. prompt logprobs (echo) ---------------------------------------------------------------------


def test_echo_loglikelihood_equals_offline(deployment: Deployment, offline_llm) -> None:
    """What lm-eval's local-completions sends for a loglikelihood request: token ids, echo, logprobs 1,
    max_tokens 1; the sum over the continuation of token_logprobs[ctxlen:-1]."""
    ids = offline_llm.tokenizer.encode(LONG + " The end.")
    expected = offline(offline_llm, ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    api = client(deployment)
    for _ in range(2):  # the second time P holds the prefix: prompt logprobs recompute it anyway
        reply = api.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
        lp = reply.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
        got = lp.token_logprobs[1:len(ids)]
        want = [e["logprob"] for e in expected.prompt_logprobs[1:]]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
        ctx = len(ids) - 4
        assert abs(sum(lp.token_logprobs[ctx:-1]) - sum(want[ctx - 1:])) < 1e-3
        assert reply.choices[0].text.startswith(LONG[:40])
    vllm = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    entries = vllm.model_extra.get("choices", [{}])[0] if vllm.model_extra else None
    prompt_logprobs = vllm.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(offline_llm.tokenizer.encode(PROMPT))
    assert all(len(p) >= 2 for p in prompt_logprobs[1:]), entries


def lm_eval_parse(reply: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval 0.4.13's LocalCompletionsAPI.parse_logprobs, restated (lm-eval is the `eval` extra, which
    setup.sh leaves out: 42 more packages, ~100 MB, ~3 min on 2 cores): choices in index order, one per prompt;
    the continuation's token_logprobs[ctxlen:-1] summed; greedy when each equals the max of its top_logprobs."""
    results = []
    for choice, ctxlen in zip(sorted(reply["choices"], key=itemgetter("index")), ctxlens, strict=True):
        tokens = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        results.append((sum(tokens), all(t == max(top.values()) for t, top in zip(tokens, tops, strict=True))))
    return results


def test_lm_eval_batched_loglikelihood_equals_offline(deployment: Deployment, offline_llm) -> None:
    """lm-eval's request at batch_size 8: eight token-id prompts in one /v1/completions call, exactly its payload
    (benchmarks/lm_eval_local.py runs lm-eval itself). The prompts are two questions of
    benchmarks/lm_eval_tasks/pdserve_facts.jsonl with each choice; the default model's top-1 is the whole
    continuation for one choice of each (doc 1 choice 2, doc 8 choice 1), so is_greedy is seen both ways."""
    task = Path(__file__).resolve().parents[2] / "benchmarks" / "lm_eval_tasks" / "pdserve_facts.jsonl"
    docs = [json.loads(line) for line in task.read_text().splitlines()]
    encode = offline_llm.tokenizer.encode
    pairs = []  # as lm-eval's TemplateLM._encode_pair: the continuation is the whole minus the context
    for doc in (docs[1], docs[8]):
        context = f"Question: {doc['question']}\nAnswer:"
        for choice in doc["choices"]:
            whole, ctx = encode(context + " " + choice, False), encode(context, False)
            pairs.append((ctx, whole[len(ctx):]))
    prompts = [ctx + cont for ctx, cont in pairs]
    reply = client(deployment).completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=1,
                                                  logprobs=1, seed=1234, echo=True)
    got = lm_eval_parse(reply.model_dump(), [len(ctx) for ctx, _ in pairs])
    scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    want = []
    for (ctx, _), prompt in zip(pairs, prompts, strict=True):
        entries = offline(offline_llm, prompt, scoring).prompt_logprobs[len(ctx):]
        want.append((sum(e["logprob"] for e in entries), all(e["rank"] == 1 for e in entries)))
    assert [g for _, g in want] == [False, False, True, False, False, True, False, False]
    assert [g for _, g in got] == [g for _, g in want]
    assert max(abs(a - b) for (a, _), (b, _) in zip(got, want, strict=True)) < 1e-4, (got, want)


# ---- 5. tokenize, detokenize, version, refused fields -----------------------------------------------


def test_tokenize_detokenize_version_and_refused_fields(deployment: Deployment, offline_llm) -> None:
    tokens = httpx.post(f"{deployment.url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert tokens["tokens"] == offline_llm.tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    assert "".join(tokens["token_strs"]) == PROMPT and tokens["max_model_len"] > 0
    assert httpx.post(f"{deployment.url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": PROMPT}
    assert httpx.get(f"{deployment.url}/version").json()["version"]
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client(deployment).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"min_tokens": 2})
    kept = client(deployment).completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=8, temperature=0,
                                                 stop=[" three"], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(" three") or kept.choices[0].finish_reason == "length"
