"""Render chat messages through the model's own chat template into a Prompt.

The template is the GGUF's ``tokenizer.chat_template`` (Jinja), rendered in a
sandbox.  Message spans cost one extra render, not one per prefix: every
non-empty content is wrapped in private-use sentinels, the marked conversation
is rendered once, and the sentinels' offsets (checked to leave exactly the
real rendering when removed) become token spans through the tokens' byte
lengths.  A template that rewrites content fails that check, and the prompt
then carries no spans (the guard treats it as a raw prompt).
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import orjson
import structlog
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from core import tool_section
from core.errors import InvalidRequest
from core.prompt import Prompt, Span
from core.spans import common_prefix

if TYPE_CHECKING:  # tokenizing needs llama.cpp; rendering and validation do not
    from core.llama.model import Model

log = structlog.get_logger("specgate.chat")
ROLES = ("system", "user", "assistant", "tool")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
OPEN, CLOSE = "\ue000", "\ue001"  # private-use code points: no tokenizer or template gives them meaning
SENTINEL = re.compile(f"{OPEN}([se])(\\d+){CLOSE}")


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    # HF's tojson: no HTML escaping, unicode kept
    return json.dumps(value, ensure_ascii=False, indent=indent)


def mark(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with every non-empty content between a start and an end sentinel."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        out.append({**m, "content": f"{OPEN}s{i}{CLOSE}{content}{OPEN}e{i}{CLOSE}"} if content else m)
    return out


def content_offsets(marked_text: str, text: str) -> dict[tuple[str, int], int] | None:
    """Byte offsets, in ``text``, of each sentinel of ``marked_text``: ``("s"|"e", i)``.
    None when removing the sentinels does not give exactly ``text``."""
    offsets: dict[tuple[str, int], int] = {}
    plain: list[str] = []
    at = 0
    pos = 0
    for m in SENTINEL.finditer(marked_text):
        piece = marked_text[pos:m.start()]
        plain.append(piece)
        at += len(piece.encode("utf-8"))
        offsets[(m.group(1), int(m.group(2)))] = at
        pos = m.end()
    plain.append(marked_text[pos:])
    return offsets if "".join(plain) == text else None


def message_bounds(offsets: dict[tuple[str, int], int], n_messages: int, n_bytes: int,
                   preamble: bool) -> list[tuple[str | int, int, int]]:
    """Byte spans ``(index, start, end)`` of the messages (index ``"preamble"`` for a tool
    block the template puts before the first message's content).

    A message runs from its content to the next message's content, so the template's
    text between them -- the end marker, the next header, tool definitions appended to
    the system prompt -- belongs to the message before.  A message without content (a
    tool call) starts where the previous content ended; the last message ends with its
    content, leaving the generation prompt after every span."""
    starts = []
    for i in range(n_messages):
        if ("s", i) in offsets:
            starts.append(offsets[("s", i)])
        elif i and ("e", i - 1) in offsets:
            starts.append(offsets[("e", i - 1)])
        else:
            starts.append(starts[-1] if starts else 0)
    out: list[tuple[str | int, int, int]] = []
    if preamble and starts and starts[0] > 0:
        out.append(("preamble", 0, starts[0]))
    else:
        starts[0:1] = [0] * bool(starts)
    last = n_messages - 1
    ends = [*starts[1:], offsets.get(("e", last), n_bytes)] if n_messages else []
    out += [(i, a, max(a, b)) for i, (a, b) in enumerate(zip(starts, ends, strict=True))]
    return out


class ChatTemplate:
    """The model's chat template.  Two gaps in some templates are filled here, and logged:
    a template that renders no tools gets them as a generic tool section in the system
    prompt (:mod:`core.tool_section`, as llama-server does), and one that refuses a system
    message after the first gets it folded into the system prompt."""

    def __init__(self, model: Model) -> None:
        self.model = model
        source = model.meta("tokenizer.chat_template") or CHATML
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source)
        self.renders_tools = tool_section.template_renders_tools(self._render)
        log.info("chat_template", tools="native" if self.renders_tools else "generic_section")

    def _render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                add_generation_prompt: bool) -> str:
        return self._template.render(messages=list(messages), tools=list(tools) if tools else None,
                                     add_generation_prompt=add_generation_prompt, bos_token="", eos_token="")

    def render_text(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                    add_generation_prompt: bool) -> str:
        if tools and not self.renders_tools:
            messages, tools = tool_section.with_tool_section(messages, tools), None
        try:
            return self._render(messages, tools, add_generation_prompt)
        except (TemplateError, RecursionError) as exc:
            folded = fold_system(messages)
            if folded is not None:
                log.debug("system_messages_folded", n=len(messages) - len(folded))
                return self.render_text(folded, tools, add_generation_prompt)
            raise InvalidRequest(f"chat template rejected the messages: {exc}") from exc

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                    has_grammar: bool = False) -> Prompt:
        """OpenAI-form messages (what sessions store: call arguments as JSON strings) as a Prompt."""
        return self.render([for_template(m) for m in messages], tools, has_grammar)

    def resend_form(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> list[int]:
        """The tokens every next request starts with when it resends ``messages`` (OpenAI form,
        the last an assistant message calling tools) and the calls' results: the held reply
        in the template's form, and the results' opening.  Two renderings with results that
        differ from their first character agree that far, whatever the template wraps them in."""
        calls = messages[-1].get("tool_calls") or []
        probes = []
        for mark_ in ("0", "x"):
            results = [{"role": "tool", "tool_call_id": c.get("id", ""), "content": mark_} for c in calls]
            text = self.render_text([for_template(m) for m in [*messages, *results]], tools,
                                    add_generation_prompt=True)
            probes.append(self.model.tokenize(text, add_special=True, parse_special=True))
        return probes[0][:common_prefix(*probes)]

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
               has_grammar: bool = False) -> Prompt:
        validate_messages(messages)
        text = self.render_text(messages, tools, add_generation_prompt=True)
        tokens = self.model.tokenize(text, add_special=True, parse_special=True)
        spans = self._spans(text, tokens, messages, tools)
        return Prompt(tuple(tokens), tuple(spans), has_tools=bool(tools), has_grammar=has_grammar)

    def _spans(self, text: str, tokens: list[int], messages: Sequence[dict[str, Any]],
               tools: Sequence[dict[str, Any]] | None) -> list[Span]:
        offsets = content_offsets(self.render_text(mark(messages), tools, add_generation_prompt=True), text)
        if offsets is None:
            return []
        ends = list(accumulate(len(self.model.token_bytes(t, special=True)) for t in tokens))
        lead = (ends[-1] if ends else 0) - len(text.encode("utf-8"))  # a BOS the text does not hold
        if lead < 0 or (lead and ends[0] != lead):
            return []
        preamble = bool(tools) and messages[0]["role"] != "system"

        def token_at(byte: int) -> int:  # the first token that ends past ``byte``
            return min(len(tokens), bisect.bisect_right(ends, byte + lead))

        spans = []
        for index, start, end in message_bounds(offsets, len(messages), ends[-1] - lead if ends else 0, preamble):
            a, b = token_at(start), token_at(end)
            if index == "preamble":
                spans.append(Span("system", a, b))
            else:
                m = messages[int(index)]
                spans.append(Span(m["role"], a, b, bool(m.get("tool_calls"))))
        return spans


def fold_system(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages with every system message after the first joined to the leading system
    prompt (one made if there is none); None when there is no such message to fold."""
    later = [m for i, m in enumerate(messages) if m.get("role") == "system" and i > 0]
    if not later:
        return None
    rest = [m for i, m in enumerate(messages) if i > 0 and m.get("role") != "system"]
    head = messages[0] if messages and messages[0].get("role") == "system" else None
    if head is None:
        rest = [messages[0], *rest] if messages else rest
    texts = [head["content"]] if head and head.get("content") else []
    system = {"role": "system", "content": "\n\n".join(texts + [m.get("content") or "" for m in later])}
    return [system, *rest]


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


def for_template(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI assistant messages carry arguments as JSON strings; templates want objects
    (as llama.cpp and vLLM render them), not a JSON string inside JSON."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = orjson.loads(fn["arguments"])
            except orjson.JSONDecodeError:
                pass
        fixed.append({**call, "function": fn, **fn})
    return {**message, "tool_calls": fixed, "content": message.get("content") or ""}
