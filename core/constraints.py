"""What a reply must look like, as an llguidance grammar: forced tool calls, JSON replies.

A :class:`Constraint` is built once per request from the protocol-independent
inputs (tools, ``tool_choice``, ``parallel_tool_calls``, a JSON schema) and the
model family's call syntax (:class:`ToolSyntax`: Qwen's ``<tool_call>`` tags
here; another family adds one entry to :data:`SYNTAXES`).  The grammar is
Lark with embedded JSON schemas (``%json``), which llguidance compiles against
the model's vocabulary on the model thread (:mod:`core.decoding.guided`).  A lazy
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
    """How a model family writes one call: ``open`` + JSON body + ``close``.  Where the
    vocabulary has them as special tokens (Qwen's does), the grammar names the tokens;
    elsewhere it spells them out as text."""

    open: str
    close: str
    name_key: str = "name"
    args_key: str = "arguments"


SYNTAXES = {"qwen": ToolSyntax(open="<tool_call>", close="</tool_call>")}
OPEN, CLOSE = "@@open@@", "@@close@@"  # placeholders in a grammar until the vocabulary is known


@dataclass(slots=True, frozen=True)
class Constraint:
    template: str  # llguidance's grammar (Lark with %json), with OPEN/CLOSE for the call tags
    kind: str  # tool_call | json_schema | json_object | json_or_tool_call
    syntax: ToolSyntax = SYNTAXES["qwen"]
    lazy: bool = False  # armed only once the model emits ``syntax.open`` as one special token

    def grammar(self, special: bool) -> str:
        """The grammar, naming the call tags as special tokens or spelling them as text."""
        def tag(text: str) -> str:
            return text if special else json.dumps(text)
        return self.template.replace(OPEN, tag(self.syntax.open)).replace(CLOSE, tag(self.syntax.close))


def _call_schema(tools: list[dict[str, Any]], syntax: ToolSyntax) -> dict[str, Any]:
    options = [{"type": "object", "additionalProperties": False, "required": [syntax.name_key, syntax.args_key],
                "properties": {syntax.name_key: {"const": t["function"]["name"]},
                               syntax.args_key: t["function"].get("parameters") or {"type": "object"}}}
               for t in tools]
    return {"anyOf": options, "x-guidance": JSON_OPTIONS} if len(options) > 1 else {**options[0],
                                                                                   "x-guidance": JSON_OPTIONS}


def _calls_rules(tools: list[dict[str, Any]], syntax: ToolSyntax, parallel: bool) -> str:
    """``calls``: one or more (``parallel``) whole calls; ``rest``: a call after its opening."""
    body = json.dumps(_call_schema(tools, syntax))
    more = f' ("\\n" {OPEN} rest)*' if parallel else ""
    return (f"calls: {OPEN} rest{more}\n"
            f'rest: "\\n" body "\\n" {CLOSE}\n'
            f"body: %json {body}\n")


def tool_call(tools: list[dict[str, Any]], choice: str, parallel: bool, syntax: ToolSyntax) -> Constraint | None:
    """``choice``: ``auto`` (lazy), ``required`` or the one function's name; ``none`` -> None.
    A named function is called exactly once, whatever ``parallel`` says (as OpenAI and vLLM
    do): a small model held to "that call, then maybe another" repeats it to ``max_tokens``."""
    if choice == "none" or not tools:
        return None
    if choice not in ("auto", "required"):
        tools = [t for t in tools if t["function"]["name"] == choice]
        parallel = False
    rules = _calls_rules(tools, syntax, parallel)
    if choice == "auto":  # the grammar picks up after the opening tag the model chose to write
        more = f' ("\\n" {OPEN} rest)*' if parallel else ""
        return Constraint(f"start: rest{more}\n{rules}", "tool_call", syntax, lazy=True)
    return Constraint(f"start: calls\n{rules}", "tool_call", syntax)


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
                      + _calls_rules(tools, syntax, parallel), "json_or_tool_call", syntax)


ERROR_CHARS = 600  # of llguidance's reason, quoted back to the client


def check(constraint: Constraint) -> Constraint:
    """The grammar compiles, or :class:`InvalidRequest` with llguidance's reason (which names
    the construct, e.g. an unsupported JSON-schema keyword)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(constraint.grammar(special=False))
    if error:  # llguidance quotes the grammar line it failed on: a schema's whole JSON, at times
        reason = error if len(error) <= ERROR_CHARS else f"{error[:ERROR_CHARS]}... ({len(error)} characters)"
        raise InvalidRequest(f"the requested output format cannot be enforced: {reason}")
    return constraint
