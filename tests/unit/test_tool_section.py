"""Tools for templates without a tool section, and system messages a template refuses mid
conversation (pure: rendered through real Jinja templates, no model)."""

from __future__ import annotations

import json

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from core import tool_section
from core.chat import fold_system

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": SCHEMA}}]
# SmolLM2's template in substance: it renders messages and never looks at ``tools``
NO_TOOLS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WITH_TOOLS = "{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n{% endif %}" \
    + NO_TOOLS
SYSTEM_FIRST_ONLY = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                     "{{ raise_exception('System message must be first') }}{% endif %}"
                     "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


def renderer(source: str):
    env = ImmutableSandboxedEnvironment()

    def fail(message: str) -> None:
        raise TemplateError(message)
    env.globals["raise_exception"] = fail
    template = env.from_string(source)
    return lambda messages, tools, gen: template.render(messages=list(messages), tools=tools,
                                                        add_generation_prompt=gen)


def test_the_probe_tells_a_template_that_renders_tools_from_one_that_does_not():
    assert tool_section.template_renders_tools(renderer(WITH_TOOLS)) is True
    assert tool_section.template_renders_tools(renderer(NO_TOOLS)) is False


def test_the_generic_section_puts_the_tools_and_the_call_syntax_in_the_system_prompt():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read a.txt"}]
    out = tool_section.with_tool_section(messages, TOOLS)
    text = renderer(NO_TOOLS)(out, None, True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in text and "<tool_call>" in text and "</tool_call>" in text
    assert len(out) == 2 and out[1] == messages[1]
    no_system = tool_section.with_tool_section(messages[1:], TOOLS)
    assert no_system[0]["role"] == "system" and "read_file" in no_system[0]["content"]


def test_earlier_calls_are_written_back_in_the_call_syntax():
    call = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'}}
    messages = [{"role": "user", "content": "Read a.txt"},
                {"role": "assistant", "content": "Reading.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "hello"}]
    out = tool_section.with_tool_section(messages, TOOLS)
    assistant = out[2]
    assert "tool_calls" not in assistant
    assert assistant["content"] == 'Reading.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n' \
                                   "</tool_call>"


def test_a_system_message_the_template_refuses_is_folded_into_the_system_prompt():
    messages = [{"role": "system", "content": "Main."}, {"role": "user", "content": "Hi"},
                {"role": "system", "content": "Env: linux"}, {"role": "user", "content": "Go"}]
    folded = fold_system(messages)
    assert folded == [{"role": "system", "content": "Main.\n\nEnv: linux"}, {"role": "user", "content": "Hi"},
                      {"role": "user", "content": "Go"}]
    assert renderer(SYSTEM_FIRST_ONLY)(folded, None, False).startswith("system: Main.\n\nEnv: linux")
    assert fold_system(folded) is None  # nothing left to fold
    no_head = fold_system([{"role": "user", "content": "Hi"}, {"role": "system", "content": "Env"}])
    assert no_head == [{"role": "system", "content": "Env"}, {"role": "user", "content": "Hi"}]
