"""What a reply must look like, as an llguidance grammar: forced tool calls, JSON replies.

A :class:`Constraint` is built once per request from the protocol-independent
inputs (tools, ``tool_choice``, ``parallel_tool_calls``, a JSON schema) and the
model family's call syntax (:class:`ToolSyntax`: Qwen's ``<tool_call>`` tags
here; another family adds one entry to :data:`SYNTAXES`).  The grammar is
Lark with embedded JSON schemas (``%json``), which llguidance compiles against
the model's vocabulary on the model thread (:mod:`core.guided`).  A lazy
constraint (``tool_choice: auto``) leaves the model free until it emits the
syntax's opening token; from there the call must name an offered tool and
its arguments must satisfy that tool's schema.

Everything here is pure: :func:`check` validates a grammar without a model,
so an uncompilable schema is a 400 naming the construct before anything runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from core.errors import InvalidRequest

# compact JSON: no free whitespace a model could pad forever, the separators Qwen writes
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(slots=True, frozen=True)
class ToolSyntax:
    """How a model family writes one call: ``open`` + JSON body + ``close`` (special tokens in
    llguidance's ``<name>`` form when the vocabulary has them)."""

    open: str
    close: str
    open_special: bool  # ``open`` is one special token (the lazy trigger)
    name_key: str = "name"
    args_key: str = "arguments"


SYNTAXES = {"qwen": ToolSyntax(open="<tool_call>", close="</tool_call>", open_special=True)}


@dataclass(slots=True, frozen=True)
class Constraint:
    grammar: str  # llguidance's grammar (Lark with %json)
    kind: str  # tool_call | json_schema | json_object | json_or_tool_call
    lazy: bool = False  # armed only once the model opens a call
    trigger: str = ""  # the special token that arms a lazy constraint


def _call_schema(tools: list[dict[str, Any]], syntax: ToolSyntax) -> dict[str, Any]:
    options = [{"type": "object", "additionalProperties": False, "required": [syntax.name_key, syntax.args_key],
                "properties": {syntax.name_key: {"const": t["function"]["name"]},
                               syntax.args_key: t["function"].get("parameters") or {"type": "object"}}}
               for t in tools]
    return {"anyOf": options, "x-guidance": JSON_OPTIONS} if len(options) > 1 else {**options[0],
                                                                                   "x-guidance": JSON_OPTIONS}


def _token(text: str, special: bool) -> str:
    return text if special else json.dumps(text)


def _calls_rules(tools: list[dict[str, Any]], syntax: ToolSyntax, parallel: bool) -> str:
    """``calls``: one or more (``parallel``) whole calls; ``rest``: a call after its opening."""
    body = json.dumps(_call_schema(tools, syntax))
    open_, close = _token(syntax.open, syntax.open_special), _token(syntax.close, syntax.open_special)
    more = f' ("\\n" {open_} rest)*' if parallel else ""
    return (f"calls: {open_} rest{more}\n"
            f'rest: "\\n" body "\\n" {close}\n'
            f"body: %json {body}\n")


def tool_call(tools: list[dict[str, Any]], choice: str, parallel: bool, syntax: ToolSyntax) -> Constraint | None:
    """``choice``: ``auto`` (lazy), ``required`` or the one function's name; ``none`` -> None."""
    if choice == "none" or not tools:
        return None
    if choice not in ("auto", "required"):
        tools = [t for t in tools if t["function"]["name"] == choice]
    rules = _calls_rules(tools, syntax, parallel)
    if choice == "auto":
        if not syntax.open_special:
            return None  # no single token to arm on: the parser alone reads the calls
        more = f' ("\\n" {syntax.open} rest)*' if parallel else ""
        return Constraint(f"start: rest{more}\n{rules}", "tool_call", lazy=True, trigger=syntax.open)
    return Constraint(f"start: calls\n{rules}", "tool_call")


def json_reply(schema: dict[str, Any] | None) -> Constraint:
    """A JSON reply: valid against ``schema``, or any JSON object (``json_object``)."""
    body = {**(schema or {"type": "object"}), "x-guidance": JSON_OPTIONS}
    return Constraint(f"start: %json {json.dumps(body)}\n", "json_schema" if schema else "json_object")


def json_or_tool_call(schema: dict[str, Any] | None, tools: list[dict[str, Any]], parallel: bool,
                      syntax: ToolSyntax) -> Constraint:
    """``response_format`` beside tools the model may call (``auto``): a reply is either the
    JSON answer or calls."""
    body = {**(schema or {"type": "object"}), "x-guidance": JSON_OPTIONS}
    return Constraint(f"start: answer | calls\nanswer: %json {json.dumps(body)}\n"
                      + _calls_rules(tools, syntax, parallel), "json_or_tool_call")


def check(constraint: Constraint) -> Constraint:
    """The grammar compiles, or :class:`InvalidRequest` with llguidance's reason (which names
    the construct, e.g. an unsupported JSON-schema keyword)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(constraint.grammar)
    if error:
        raise InvalidRequest(f"the requested output format cannot be enforced: {error}")
    return constraint
