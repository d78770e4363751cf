"""Tool calls on chat completions: what `tools` / `tool_choice` ask of the model, and how the history is rendered.

    tool_choice      the model is                                   its output is parsed as
    ───────────      ────────────                                   ───────────────────────
    none             told nothing of the tools                      text
    auto (default)   shown the tools, free to answer or call        the parser's format (--tool-call-parser,
                                                                    hermes: <tool_call>{"name", "arguments"}</tool_call>)
    required         constrained to a JSON array of one or more      [{"name", "parameters"}, ...] (as vLLM)
                     {"name", "parameters"} matching the tools' schemas
    {"function": {"name"}}  constrained to that function's          the arguments object itself
                     parameters schema

`required` and named choices go through structured outputs (router/structured.py's StructuredOutput, compiled by
the workers), so even the 135M default model returns arguments that validate against the schemas.

Templates that know tools (they mention `tools` / `tool_calls`) get them as transformers passes them: `tools=`
and assistant messages with `tool_calls` (arguments as objects). A template that does not (the default model's
ChatML) gets what the hermes format would show: a system preamble listing the tools in <tools></tools>, and
earlier calls written into the assistant's content as <tool_call> blocks; `tool` messages are rendered by the
template as any other role.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.engine.structured_output import StructuredOutput
from pdserve.router.errors import bad_request
from pdserve.router.protocol import ChatCompletionRequest

TOOL_CALL_PARSERS = ("hermes",)
_HERMES_PREAMBLE = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>{tools}</tools> For each function call "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>"
)


@dataclass(frozen=True)
class ToolPlan:
    choice: str  # "none" | "auto" | "required" | "named"
    tools: tuple[dict[str, Any], ...]  # the "function" objects: {name, description?, parameters?}
    name: str | None = None  # the named choice's function
    parallel: bool = True
    parser: str = "hermes"

    @property
    def parses_output(self) -> bool:
        return self.choice != "none"

    def constraint(self) -> StructuredOutput | None:
        if self.choice == "named":
            return StructuredOutput.json_schema(_parameters(self._function(self.name)))
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                                       "parameters": _parameters(f)},
                      "required": ["name", "parameters"]} for f in self.tools]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutput.json_schema(schema)
        return None

    def finish_reason(self, reason: str | None, num_calls: int) -> str | None:
        """OpenAI's: "tool_calls" when the model called tools (auto, required); a named choice ends with "stop"."""
        if reason != "stop" or not num_calls or self.choice == "named":
            return reason
        return "tool_calls"

    def _function(self, name: str | None) -> dict[str, Any]:
        return next(f for f in self.tools if f["name"] == name)


def plan_tools(req: ChatCompletionRequest, parser: str) -> ToolPlan | None:
    """None when the request has no tools (a tool_choice without tools is refused, as OpenAI does)."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    functions = tuple(_function_of(i, tool) for i, tool in enumerate(req.tools))
    choice, name = _choice(req.tool_choice, {f["name"] for f in functions})
    return ToolPlan(choice, functions, name, req.parallel_tool_calls, parser)


def _function_of(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(function, dict):
        raise bad_request(f"tools[{index}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools.{index}")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise bad_request(f"tools[{index}].function needs a 'name'", param=f"tools.{index}.function.name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"tools[{index}].function.parameters must be a JSON schema object",
                          param=f"tools.{index}.function.parameters")
    return function


def _choice(value: Any, names: set[str]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if value in ("none", "auto", "required"):
        return value, None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request(f"'tool_choice' must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                          f"{{'name': ...}}}}, got {value!r:.80}", param="tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools {sorted(names)}",
                          param="tool_choice")
    return "named", name


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


# ---- the prompt ----------------------------------------------------------------------------------


def render_inputs(messages: list[dict[str, Any]], plan: ToolPlan | None,
                  template: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for the chat template, tools and earlier calls included."""
    knows_tools = "tools" in template
    knows_calls = "tool_calls" in template
    out = [_rendered_call(m, knows_calls) if m.get("tool_calls") else m for m in messages]
    if plan is None or plan.choice == "none":
        return out, {}
    if knows_tools:
        return out, {"tools": [{"type": "function", "function": f} for f in plan.tools]}
    preamble = _HERMES_PREAMBLE.format(tools=json.dumps([{"type": "function", "function": f} for f in plan.tools]))
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}, *out[1:]], {}
    return [{"role": "system", "content": preamble}, *out], {}


def _rendered_call(message: dict[str, Any], knows_calls: bool) -> dict[str, Any]:
    calls = [_call_object(c) for c in message["tool_calls"]]
    if knows_calls:  # transformers' shape: arguments as an object, so a template can tojson them
        return {**message, "tool_calls": [{"type": "function", "function": c, "id": c.pop("id", None)}
                                          for c in calls]}
    blocks = "\n".join(f"<tool_call>\n{json.dumps({'name': c['name'], 'arguments': c['arguments']})}\n</tool_call>"
                       for c in calls)
    text = message.get("content") or ""
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": f"{text}{blocks}"}


def _call_object(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        raise bad_request(f"tool call {function.get('name')!r} has arguments that are not JSON: {arguments!r:.80}",
                          param="messages") from None
    return {"name": function.get("name"), "arguments": parsed, "id": call.get("id")}
