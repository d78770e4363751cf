"""The OpenAI API through a real router (uvicorn, loopback) with the official `openai` client."""

from __future__ import annotations

from fake_workers import expected_text


def test_completion_non_streaming(cluster) -> None:
    client = cluster.client()
    out = client.completions.create(model="smollm2-135m-instruct", prompt="Hello there", max_tokens=5, seed=3)
    assert out.id.startswith("cmpl-")
    assert out.object == "text_completion"
    assert out.choices[0].text == expected_text(3, 5)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens == len(cluster.state.tokenizer.encode("Hello there"))
