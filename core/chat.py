"""Render chat messages through the model's own chat template into a Prompt.

The template is the GGUF's ``tokenizer.chat_template`` (Jinja), rendered in a
sandbox.  Message token spans come from rendering each prefix of the
conversation, so the guard knows where system and tool messages sit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from core.errors import InvalidRequest
from core.prompt import Prompt, Span

if TYPE_CHECKING:  # tokenizing needs llama.cpp; rendering and validation do not
    from core.llama_bindings import Model

ROLES = ("system", "user", "assistant", "tool")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    # HF's tojson: no HTML escaping, unicode kept
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    def __init__(self, model: Model) -> None:
        self.model = model
        source = model.meta("tokenizer.chat_template") or CHATML
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source)

    def render_text(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                    add_generation_prompt: bool) -> str:
        try:
            return self._template.render(messages=list(messages), tools=list(tools) if tools else None,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token="", eos_token="")
        except TemplateError as exc:
            raise InvalidRequest(f"chat template rejected the messages: {exc}") from exc

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
               has_grammar: bool = False) -> Prompt:
        validate_messages(messages)
        text = self.render_text(messages, tools, add_generation_prompt=True)
        tokens = self.model.tokenize(text, add_special=True, parse_special=True)
        spans = self._preamble(text, messages, tools)
        start = spans[0].end if spans else 0
        for i, message in enumerate(messages):
            prefix = self.render_text(messages[: i + 1], tools, add_generation_prompt=False)
            end = min(len(tokens), len(self.model.tokenize(prefix, add_special=True, parse_special=True)))
            spans.append(Span(message["role"], start, end, bool(message.get("tool_calls"))))
            start = end
        return Prompt(tuple(tokens), tuple(spans), has_tools=bool(tools), has_grammar=has_grammar)

    def _preamble(self, text: str, messages: Sequence[dict[str, Any]],
                  tools: Sequence[dict[str, Any]] | None) -> list[Span]:
        """Templates put tool definitions in a system block of their own when the
        conversation has no system message; that block is a span too."""
        first = messages[0]
        if not tools or first["role"] == "system" or not first.get("content"):
            return []
        at = text.find(first["content"])
        if at <= 0:
            return []
        end = len(self.model.tokenize(text[:at], add_special=True, parse_special=True))
        return [Span("system", 0, end)] if end else []


def validate_messages(messages: Sequence[dict[str, Any]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object")
        if m.get("role") not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {ROLES}, got {m.get('role')!r}")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            raise InvalidRequest(f"messages[{i}].content is required")
        if content is not None and not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string")
