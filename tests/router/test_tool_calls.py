"""Tool calls at the router: the hermes parser on whole outputs and streamed ones (every split of the text
gives the same calls), the constraint `required` and named choices send to the workers, the rendering of tools
and earlier calls for a template that knows neither, and streamed deltas through a real router."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.router.protocol import ChatCompletionRequest
from pdserve.router.tool_calls import plan_tools, render_inputs
from pdserve.router.tool_parser import ToolCallStream, parse

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


def plan(choice: object = None):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice=choice)
    return plan_tools(req, "hermes")


def streamed(text: str, tool_plan, step: int) -> tuple[str, list[dict]]:
    stream, deltas = ToolCallStream(tool_plan), []
    for i in range(0, len(text), step):
        deltas += stream.feed(text[i:i + step])
    deltas += stream.finish()
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"name": "", "arguments": "", "id": None})
            call["id"] = call["id"] or tc.get("id")
            call["name"] += tc.get("function", {}).get("name", "")
            call["arguments"] += tc.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def test_hermes_whole_output() -> None:
    content, calls = parse(HERMES, plan())
    assert content == "Let me check. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_weather", {"city": "Oslo"})]
    assert plan().finish_reason("stop", len(calls)) == "tool_calls"
    assert parse("no calls here", plan()) == ("no calls here", [])


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_hermes_stream_equals_whole_output(step: int) -> None:
    content, calls = streamed(HERMES, plan(), step)
    assert content == "Let me check. "
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                        ("get_weather", {"city": "Oslo"})]
    assert all(c["id"] for c in calls)
    assert streamed("a <tool_ca", plan(), 1)[0] == "a <tool_ca"  # a prefix of the tag that never completes


def test_required_and_named_constraints() -> None:
    required = plan("required")
    schema = json.loads(required.constraint().spec)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    _, calls = parse('[{"name": "get_weather", "parameters": {"city": "Rome"}}]', required)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]
    named = plan({"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.constraint().spec) == WEATHER["function"]["parameters"]
    _, calls = streamed('{"city": "Rome"}', named, 3)
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Rome"}', "id": calls[0]["id"]}]
    assert named.finish_reason("stop", 1) == "stop"  # as OpenAI: a forced function ends with "stop"


def test_tools_and_calls_rendered_for_a_template_without_tools() -> None:
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    rendered, variables = render_inputs(messages, plan(), "{{ messages }}")
    assert variables == {} and rendered[0]["role"] == "system" and "<tools>" in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert rendered[3] == messages[2]
    with_tools, variables = render_inputs(messages, plan(), "{% for tool in tools %}{% endfor %}{{ tool_calls }}")
    assert variables["tools"] == [WEATHER] and with_tools[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Oslo"}
    assert render_inputs(messages, plan("none"), "")[0][0]["role"] == "user"  # none: the model is not told


def test_named_tool_call_streams_through_the_router(cluster) -> None:
    """FAKE workers emit ' s-1-0 s-1-1'; a named choice streams them as the arguments of one call."""
    stream = cluster.client().chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=2, stream=True)
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert calls[0].index == 0 and calls[0].id and calls[0].function.name == "get_weather"
    assert "".join(tc.function.arguments or "" for tc in calls) == " s-1-0 s-1-1"
    assert chunks[-1].choices[0].finish_reason == "length"
    sampling = cluster.decode[0].requests[cluster.decode[0].reserved[-1]].sampling
    assert sampling["structured"]["kind"] == "json"
