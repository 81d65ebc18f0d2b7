"""Tools for a chat template that has no tool section of its own (SmolLM2's, say): without
this they would be silently left out of the prompt, and the model would never see them.

The section is the Hermes/Qwen form llama-server also falls back to, in the call syntax the
gateway parses and constrains (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``,
:data:`core.constraints.SYNTAXES`); an assistant's earlier calls are written back in
that same syntax, so the history reads as the model would have written it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from core.constraints import SYNTAXES

SYNTAX = SYNTAXES["qwen"]
PROBE_NAME = "specgate_probe_tool_7f3a"  # a name no template writes unless it renders the tools it is given
HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
          "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
FOOTER = ("</tools>\n\nFor each function call, return a json object with function name and arguments within "
          f"{SYNTAX.open}{SYNTAX.close} XML tags:\n{SYNTAX.open}\n"
          '{"name": <function-name>, "arguments": <args-json-object>}\n' + SYNTAX.close)

Render = Callable[[Sequence[dict[str, Any]], Sequence[dict[str, Any]] | None, bool], str]


def template_renders_tools(render: Render) -> bool:
    """Whether the template puts the tools it is given into the prompt (probed with one)."""
    probe = [{"type": "function", "function": {"name": PROBE_NAME, "description": "", "parameters": {}}}]
    try:
        return PROBE_NAME in render([{"role": "user", "content": "hi"}], probe, True)
    except Exception:  # a template that fails on tools cannot render them either
        return False


def section(tools: Sequence[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return f"{HEADER}\n{lines}\n{FOOTER}"


def call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    body = json.dumps({SYNTAX.name_key: fn.get("name"), SYNTAX.args_key: args}, ensure_ascii=False)
    return f"{SYNTAX.open}\n{body}\n{SYNTAX.close}"


def with_tool_section(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tool section after the system prompt (a system message made if
    there is none) and each assistant tool call as text in its message."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            text = "\n".join([*([m["content"]] if m.get("content") else []), *(call_text(c) for c in calls)])
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
        out.append(m)
    if out and out[0].get("role") == "system":
        head = out[0].get("content") or ""
        return [{**out[0], "content": f"{head}\n\n{section(tools)}" if head else section(tools)}, *out[1:]]
    return [{"role": "system", "content": section(tools)}, *out]
