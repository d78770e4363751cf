"""Every bad input class answers the right status with OpenAI-style error JSON (and the openai client raises
the matching exception)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Hi"}]


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_unknown_model_is_404(cluster) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        cluster.client().completions.create(model="gpt-9", prompt="Hi", max_tokens=1)
    assert info.value.code == "model_not_found"
    assert "gpt-9" in info.value.message


def test_prompt_too_long_names_both_numbers(cluster) -> None:
    tokenizer = cluster.state.tokenizer
    text = "hello " * 2100
    messages = [{"role": "user", "content": text}]
    prompt_len = len(tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False))
    with pytest.raises(openai.BadRequestError) as info:
        cluster.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
    assert info.value.code == "context_length_exceeded"
    assert (f"This model's maximum context length is 2048 tokens. However, you requested {prompt_len + 10} tokens "
            f"({prompt_len} in the messages, 10 in the completion)") in info.value.message


def test_completion_prompt_plus_max_tokens_too_long(cluster) -> None:
    prompt = list(range(2040))
    error = _error(httpx.post(f"{cluster.url}/v1/completions",
                              json={"model": MODEL, "prompt": prompt, "max_tokens": 10}), 400)
    assert "you requested 2050 tokens (2040 in the prompt, 10 in the completion)" in error["message"]
    assert error["param"] == "prompt"


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_max_tokens_below_one(cluster, max_tokens: int) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=max_tokens)
    assert info.value.param == "max_tokens" and str(max_tokens) in info.value.message


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", 3.0), ("top_p", 0.0), ("n", 0), ("presence_penalty", 5), ("top_k", -3), ("min_p", 2),
    ("max_tokens", "many"), ("seed", "x"), ("stream", "maybe"), ("logprobs", 50),
])
def test_out_of_range_parameters_are_400_not_422(cluster, field: str, value: object) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, field: value}
    error = _error(httpx.post(f"{cluster.url}/v1/completions", json=body), 400)
    assert error["param"] == field and field in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop strings"),
    ({"prompt": "Hi", "stop": [1]}, "stop", "list of strings"),
    ({"prompt": ""}, "prompt", "non-empty"),
    ({"prompt": []}, "prompt", "non-empty"),
    ({"prompt": [1, "a"]}, "prompt", "prompt 0"),
    ({"prompt": [10**9]}, "prompt", "token ids must be in"),
    ({"prompt": "Hi", "min_tokens": 3}, "min_tokens", "not supported"),
    ({"prompt": "Hi", "guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "one structured-output"),
    ({"prompt": "Hi", "guided_json": [1]}, "guided_json", "must be an object"),
    ({"prompt": "Hi", "logit_bias": {"1": 5}}, "logit_bias", "not supported"),
    ({"prompt": "Hi", "best_of": 3}, "best_of", "best_of"),
    ({"prompt": "Hi", "n": 1000}, "n", "at most"),
    # integers past 64 bits were a 500 (msgpack could not carry them to the workers)
    ({"prompt": "Hi", "seed": 1 << 70}, "seed", "seed must be in [-9223372036854775808, 9223372036854775807]"),
    ({"prompt": "Hi", "seed": -(1 << 70)}, "seed", "got -1180591620717411303424"),
    ({"prompt": "Hi", "top_k": 1 << 70}, "top_k", "top_k must be -1 (off) or in [1, 9223372036854775807]"),
    ({"prompt": "Hi", "stop_token_ids": [1 << 70]}, "stop_token_ids", "stop_token_ids must be in [0, "),
    ({}, "prompt", "Missing required parameter: 'prompt'"),
])
def test_bad_completion_inputs(cluster, body: dict, param: str, words: str) -> None:
    error = _error(httpx.post(f"{cluster.url}/v1/completions", json={"model": MODEL, **body}), 400)
    assert error["param"] == param and words in error["message"], error


def test_n_samples_from_the_largest_seed_are_served(cluster) -> None:
    """Sample i of n takes seed + i, wrapped at the 64-bit edge: the largest seed is valid for n > 1 too."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "n": 2, "seed": (1 << 63) - 1, "temperature": 1.0}
    reply = httpx.post(f"{cluster.url}/v1/completions", json=body)
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 2, reply.text


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"messages": []}, "messages", "messages"),
    ({"messages": "hello"}, "messages", "messages"),
    ({"messages": [{"content": "x"}]}, "messages.0.role", "Missing"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", "only text content parts"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {}}]}, "tools.0.function.name", "needs a 'name'"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not among the tools"),
    ({"messages": CHAT, "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format.type", "not supported"),
    ({"messages": CHAT, "use_beam_search": True}, "use_beam_search", "not supported"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens", "below minimum"),
])
def test_bad_chat_inputs(cluster, body: dict, param: str, words: str) -> None:
    error = _error(httpx.post(f"{cluster.url}/v1/chat/completions", json={"model": MODEL, **body}), 400)
    assert error["param"] == param and words in error["message"], error


def test_malformed_json_is_400(cluster) -> None:
    response = httpx.post(f"{cluster.url}/v1/completions", content=b'{"model": "x", "prompt": ',
                          headers={"content-type": "application/json"})
    error = _error(response, 400)
    assert "could not parse the JSON body" in error["message"]


def test_unknown_route_is_json_404(cluster) -> None:
    error = _error(httpx.get(f"{cluster.url}/v1/nothing"), 404)
    assert error["code"] == "not_found"


def test_openai_client_raises_bad_request(cluster) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        cluster.client().chat.completions.create(model=MODEL, messages=CHAT, temperature=9)
    assert info.value.param == "temperature"


def test_no_decode_worker_is_503_with_retry_after(make_cluster) -> None:
    cluster = make_cluster(num_decode=0)
    start = time.monotonic()
    response = httpx.post(f"{cluster.url}/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert time.monotonic() - start < 2
    error = _error(response, 503)
    assert response.headers["retry-after"] == "1"
    assert "no decode worker" in error["message"]
    health = httpx.get(f"{cluster.url}/health")
    assert health.status_code == 503 and health.json()["workers"] == {"prefill": 1, "decode": 0}


def test_all_decode_workers_full_is_503_with_their_retry_after(make_cluster) -> None:
    cluster = make_cluster(num_decode=2)
    for decode in cluster.decode:
        decode.full = True
    with pytest.raises(openai.APIStatusError) as info:
        cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert info.value.status_code == 503
    assert info.value.response.headers["retry-after"] == "2"
    assert "no free KV blocks" in info.value.message
