"""The OpenAI API through a real router (uvicorn, loopback) with the official `openai` client, in front of
FAKE workers (tests/router/fake_workers.py) until the real nodes exist."""

from __future__ import annotations

import json

import httpx
import pytest
from fake_workers import expected_text, token_text

MODEL = "smollm2-135m-instruct"


def test_completion_non_streaming(cluster) -> None:
    out = cluster.client().completions.create(model=MODEL, prompt="Hello there", max_tokens=5, seed=3)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].index == 0
    assert out.choices[0].text == expected_text(3, 5)
    assert out.choices[0].finish_reason == "length"
    prompt_tokens = len(cluster.state.tokenizer.encode("Hello there"))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 5)
    assert out.usage.total_tokens == prompt_tokens + 5
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_streaming(cluster) -> None:
    chunks = list(cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected_text(None, 4)
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, None, "length"]
    assert all(c.id == chunks[0].id and c.usage is None for c in chunks)


def test_stream_ends_with_done_and_usage_chunk(cluster) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["usage"]["total_tokens"] == chunks[-1]["usage"]["prompt_tokens"] + 3


def test_include_usage_with_openai_client(cluster) -> None:
    chunks = list(cluster.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2


def test_chat_non_streaming(cluster) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    out = cluster.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=3, seed=1)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected_text(1, 3)
    tokenizer = cluster.state.tokenizer
    expected_prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert out.usage.prompt_tokens == len(expected_prompt)
    assert cluster.decode[0].requests[cluster.decode[0].reserved[-1]].prompt_token_ids == expected_prompt


def test_chat_streaming_opens_with_the_assistant_role(cluster) -> None:
    chunks = list(cluster.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_text(None, 3)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_content_parts_and_max_completion_tokens(cluster) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    out = cluster.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_completion_tokens=2)
    assert out.usage.completion_tokens == 2
    tokenizer = cluster.state.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello\nworld"}])
    assert out.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(cluster) -> None:
    cluster.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    decode = cluster.decode[0]
    reservation = decode.requests[decode.reserved[-1]]
    assert reservation.sampling["max_tokens"] == 2048 - len(reservation.prompt_token_ids)


def test_n_samples_use_seed_plus_i(cluster) -> None:
    out = cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=3, seed=5)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [expected_text(s, 2) for s in (5, 6, 7)]
    assert out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens == len(cluster.state.tokenizer.encode("Hi"))  # the prompt counts once


def test_n_streaming_chat(cluster) -> None:
    chunks = list(cluster.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, n=2, seed=0, stream=True))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: expected_text(0, 3), 1: expected_text(1, 3)}
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason == "length") == 2


def test_list_of_prompts_gives_one_choice_per_prompt_and_sample(cluster) -> None:
    out = cluster.client().completions.create(model=MODEL, prompt=["one", "two words"], max_tokens=1, n=2,
                                              seed=10)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [token_text(10 + i, 0) for i in range(4)]
    tokenizer = cluster.state.tokenizer
    assert out.usage.prompt_tokens == len(tokenizer.encode("one")) + len(tokenizer.encode("two words"))


def test_token_id_prompts(cluster) -> None:
    out = cluster.client().completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=1)
    assert out.usage.prompt_tokens == 5
    decode = cluster.decode[0]
    assert sorted(decode.requests[r].prompt_token_ids for r in decode.reserved[-2:]) == [[1, 2, 3], [4, 5]]


def test_sampling_parameters_reach_the_workers(cluster) -> None:
    cluster.client().completions.create(
        model=MODEL, prompt="Hi", max_tokens=2, temperature=0.5, top_p=0.9, stop=["x", "y"], presence_penalty=0.5,
        frequency_penalty=0.25, seed=7, extra_body={"top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1,
                                                     "ignore_eos": True, "stop_token_ids": [5], "made_up": 1})
    decode = cluster.decode[0]
    sampling = decode.requests[decode.reserved[-1]].sampling
    assert sampling == {"max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.1,
                        "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1, "seed": 7,
                        "stop": ["x", "y"], "stop_token_ids": [5], "ignore_eos": True, "logprobs": None,
                        "prompt_logprobs": None, "structured": None, "include_stop_str_in_output": False}


def test_completion_logprobs(cluster) -> None:
    out = cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2, logprobs=1)
    logprobs = out.choices[0].logprobs
    tokenizer = cluster.state.tokenizer
    first = tokenizer.decode([1000])
    assert logprobs.tokens[0] == first and logprobs.token_logprobs == [-0.5, -0.5]
    assert logprobs.top_logprobs[0] == {first: -0.5}
    assert logprobs.text_offset == [0, len(first)]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(cluster, stream: bool) -> None:
    out = cluster.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=2, logprobs=True, top_logprobs=2, stream=stream)
    if stream:
        entries = [e for chunk in out for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    else:
        entries = out.choices[0].logprobs.content
    tokenizer = cluster.state.tokenizer
    assert [e.token for e in entries] == [tokenizer.decode([1000]), tokenizer.decode([1001])]
    assert entries[0].logprob == -0.5 and entries[0].bytes == list(entries[0].token.encode())
    assert [t.logprob for t in entries[0].top_logprobs] == [-0.5, -1.5]


def test_models_health_and_unknown_fields(cluster) -> None:
    client = cluster.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{cluster.url}/health")
    assert health.status_code == 200 and health.json()["workers"] == {"prefill": 1, "decode": 1}
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, user="u", extra_body={"whatever": [1]})
    assert out.choices[0].text == token_text(None, 0)


def test_model_may_be_omitted(cluster) -> None:
    response = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 200 and response.json()["model"] == MODEL
