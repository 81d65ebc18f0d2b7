"""The one internal turn request every wire protocol parses into, and the one result
every protocol renders back.

Each protocol module (``openai_chat``, ``openai_responses``, ``anthropic_messages``)
turns its JSON body into a frozen, validated :class:`ChatRequest` -- messages in
OpenAI chat form, which is also what a session stores -- with the helpers here
(errors name the offending field).  A finished turn becomes one
:class:`TurnResult`, its tool calls parsed once, which each protocol renders
in its own shape; ``timings`` is ``Timings.to_json()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from core import constraints
from core.config import DEFAULT_LIMITS, Limits
from core.constraints import Constraint
from core.errors import ConfigError, InvalidRequest, RequestTooLarge
from core.loader import override
from core.policies import DecodingPolicy, PrefillPolicy, SamplingParams, TurnParams, request_bounds
from core.results import Result, Timings
from gateway import chat_messages as wire
from gateway import client_hints, tool_calls

log = structlog.get_logger("specgate.http")
SAMPLING_KEYS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop")
UNSUPPORTED = ("grammar", "logprobs", "top_logprobs", "logit_bias")
# what a request may change of the server's SpecPrefill policy, with bounds (declared on the
# fields: core.config.per_request); break-even, min_tokens, the guard's sizes and keywords
# stay the server's
REQUEST_PREFILL: dict[str, tuple[type, Any, Any]] = request_bounds(PrefillPolicy)


@dataclass(slots=True, frozen=True)
class ChatRequest:
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    stream: bool
    include_usage: bool
    params: TurnParams
    session_id: str | None
    model: str
    tool_choice: str = "auto"  # auto | required | a function's name (``none`` leaves ``tools`` None)
    hint: str | None = None  # prompt_cache_key, user or metadata.user_id: narrows which conversation it continues


def _typed(body: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
        raise InvalidRequest(f"'{key}' must be {what}")
    return value


def parse_sampling(body: dict[str, Any], max_tokens_cap: int = DEFAULT_LIMITS.max_tokens_cap,
                   default_max_tokens: int = DEFAULT_LIMITS.default_max_tokens) -> SamplingParams:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise InvalidRequest("'stop' must be a string or a list of strings")
    asked = _typed(body, "max_completion_tokens", int, "an integer") or _typed(body, "max_tokens", int,
                                                                               "an integer")
    if asked is not None and asked < 1:
        raise InvalidRequest(f"'max_tokens' must be >= 1, got {asked}")
    values = {  # a ceiling, never a refusal: above the cap it is clamped (and the turn's timings say so)
        "max_tokens": min(asked or default_max_tokens, max_tokens_cap),
        "max_tokens_asked": asked or 0,
        "temperature": _typed(body, "temperature", (int, float), "a number"),
        "top_p": _typed(body, "top_p", (int, float), "a number"),
        "top_k": _typed(body, "top_k", int, "an integer"),
        "seed": _typed(body, "seed", int, "an integer"),
        "stop": tuple(stop) if stop else None,
    }
    return override(SamplingParams(), **values)


def parse_prefill(base: PrefillPolicy, raw: Any) -> PrefillPolicy:
    """``specprefill``: a boolean (on/off) or an object of prefill policy fields."""
    if raw is None:
        return base
    if isinstance(raw, bool):
        return override(base, enabled=raw)
    if not isinstance(raw, dict):
        raise InvalidRequest("'specprefill' must be a boolean or an object")
    if unknown := set(raw) - set(REQUEST_PREFILL):
        raise InvalidRequest(f"specprefill field(s) {sorted(unknown)} cannot be set per request; "
                             f"allowed: {sorted(REQUEST_PREFILL)}")
    for key, value in raw.items():
        _bounded(f"specprefill.{key}", value, *REQUEST_PREFILL[key])
    try:
        return override(base, **{k: float(v) if REQUEST_PREFILL[k][0] is float else v for k, v in raw.items()})
    except TypeError as exc:
        raise ConfigError(f"specprefill: {exc}") from exc


KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number"}


def _bounded(name: str, value: Any, kind: type, lo: Any, hi: Any) -> None:
    if kind is str:
        if value not in lo:
            raise InvalidRequest(f"'{name}' must be one of {lo}")
        return
    if kind is bool:
        ok_type = isinstance(value, bool)
    else:
        ok_type = isinstance(value, int | float if kind is float else int) and not isinstance(value, bool)
    if not ok_type:
        raise InvalidRequest(f"'{name}' must be {KIND_NAMES[kind]}")
    if lo is not None and not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be in [{lo}, {hi}], got {value}")


def parse_decoding(base: DecodingPolicy, body: dict[str, Any]) -> DecodingPolicy:
    """``speculative``: a boolean or {"gamma": int}; ``specattn``: a boolean or
    {"p": number, "gamma": int} (SpecAttn implies speculative decoding); ``lookup``: a boolean
    (prompt-lookup drafts).  ``"speculative": false`` asks for plain decoding, also on a
    ``--decode-auto`` server."""
    policy = base
    lookup = body.get("lookup")
    if lookup is not None and not isinstance(lookup, bool):
        raise InvalidRequest("'lookup' must be a boolean")
    if lookup is not None:
        policy = override(policy, lookup=lookup, **({"decode_auto": False} if lookup is False else {}))
    for key, fields_ in (("speculative", {"gamma"}), ("specattn", {"gamma", "p"})):
        raw = body.get(key)
        if raw is None or isinstance(raw, bool):
            policy = override(policy, **{key: raw}, **({"decode_auto": False} if raw is False else {}))
            continue
        if not isinstance(raw, dict):
            raise InvalidRequest(f"'{key}' must be a boolean or an object")
        if unknown := set(raw) - fields_:
            raise InvalidRequest(f"unknown {key} field(s) {sorted(unknown)}; known: {sorted(fields_)}")
        gamma = _typed(raw, "gamma", int, "an integer")
        p = _typed(raw, "p", (int, float), "a number")
        policy = override(policy, **{key: True}, gamma=gamma, specattn_p=p)
    return policy


def parse_chat(body: Any, defaults: TurnParams, header_session: str | None, limits: Limits = DEFAULT_LIMITS,
               n_ctx: int = 8192, header_hint: str | None = None) -> ChatRequest:
    """``defaults``: the server's policies; the request's fields override them.  ``messages``
    come back checked and reduced to the known fields (OpenAI's form, as stored).  CPU work
    on a body of up to ``--max-body-mb`` (a forced call's grammar compiles here): the routes
    run it off the event loop (gateway.bodies.off_loop)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for key in UNSUPPORTED:
        if body.get(key) is not None:
            raise InvalidRequest(f"'{key}' is not supported by this server")
    if _typed(body, "n", int, "an integer") not in (None, 1):
        raise InvalidRequest("'n' must be 1")
    stream_options = _typed(body, "stream_options", dict, "an object") or {}
    session_id = header_session or _typed(body, "session_id", str, "a string")
    tools = wire.parse_tools(body, limits)
    messages = wire.parse_messages(body.get("messages"), limits, n_ctx, wire.tools_size(tools))  # bounded first
    choice = wire.tool_choice(body.get("tool_choice"), tools)
    parallel = _typed(body, "parallel_tool_calls", bool, "a boolean") is not False
    schema, wants_json = json_format(body.get("response_format"))
    if schema is not None and wire.depth(schema, limits.max_tool_depth) > limits.max_tool_depth:
        raise RequestTooLarge(f"the response_format schema nests deeper than {limits.max_tool_depth} (max_tool_depth)")
    constraint = output_constraint(tools, choice, parallel, schema, wants_json)
    return ChatRequest(
        messages=messages,
        tools=tools,
        stream=bool(_typed(body, "stream", bool, "a boolean")),
        include_usage=bool(stream_options.get("include_usage")),
        params=TurnParams(prefill=parse_prefill(defaults.prefill, body.get("specprefill")),
                          decoding=parse_decoding(defaults.decoding, body),
                          sampling=override(parse_sampling(body, limits.max_tokens_cap, limits.default_max_tokens),
                                            constraint=constraint)),
        session_id=session_id,
        model=_typed(body, "model", str, "a string") or "",
        tool_choice=choice,
        hint=_hint(body, header_hint),
    )


def _hint(body: dict[str, Any], header_hint: str | None) -> str | None:
    """What the client says groups its requests (OpenAI's ``prompt_cache_key``, else a client
    session header, else ``user``; see :mod:`gateway.client_hints`): a conversation that
    names no session is continued only among those."""
    cache_key = _typed(body, "prompt_cache_key", str, "a string")
    user = _typed(body, "user", str, "a string")
    value = cache_key or header_hint or user
    return client_hints.bounded(value) if value else None


def output_constraint(tools: tuple[dict[str, Any], ...] | None, choice: str, parallel: bool,
                      schema: dict[str, Any] | None, wants_json: bool) -> Constraint | None:
    """What the reply is held to (``schema``, ``wants_json``: the parsed ``response_format``,
    :func:`json_format`).  A forced call (``required`` or a named function) wins over
    ``response_format``, which then applies to the reply after the tool results; with tools
    on ``auto`` the reply is the JSON answer or calls; a call the model starts on its own
    must name an offered tool with valid arguments -- unless a tool's schema cannot be
    compiled, which never fails an ``auto`` request: its reply is then parsed unconstrained
    (``required``, a named function and ``response_format`` stay enforced, or a 400)."""
    syntax = constraints.SYNTAXES["qwen"]  # the family tool_calls.parse reads
    offered = list(tools or ())
    if offered and choice != "auto":  # required, or one named function
        forced = constraints.tool_call(offered, choice, parallel, syntax)
        return constraints.check(forced) if forced else None
    if wants_json:
        built = constraints.json_or_tool_call(schema, offered, parallel, syntax) if offered \
            else constraints.json_reply(schema)
        return constraints.check(built)
    if (lazy := constraints.tool_call(offered, "auto", parallel, syntax)) is None:
        return None
    try:
        return constraints.check(lazy)
    except InvalidRequest as exc:  # the model may still call: its reply is parsed, unconstrained
        log.warning("tool_grammar_skipped", reason=str(exc)[:300], tools=len(offered))
        return None


def json_format(raw: Any) -> tuple[dict[str, Any] | None, bool]:
    """OpenAI's ``response_format``: (the JSON schema or None, whether the reply must be JSON)."""
    if raw is None:
        return None, False
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None, False
    if kind == "json_object":
        return None, True
    if kind == "json_schema":
        spec = raw.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest("'response_format.json_schema.schema' must be a JSON schema object")
        return schema, True
    raise InvalidRequest("'response_format.type' must be 'text', 'json_object' or 'json_schema'")


# -- responses -----------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class TurnResult:
    """A finished turn as every client sees it: the final assistant message (tool calls
    parsed once, so the ids a client receives are the ones the history keeps), its
    finish reason and the timings.  The completion body, the last SSE chunk, the
    WebSocket ``done`` event and the stored history are all built from it."""

    message: dict[str, Any]
    finish_reason: str  # stop | length | tool_calls | cancelled
    timings: Timings
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return list(self.message.get("tool_calls", ()))

    @property
    def openai_finish_reason(self) -> str:
        return "stop" if self.finish_reason == "cancelled" else self.finish_reason


def turn_result(result: Result, tools: tuple[dict[str, Any], ...] | None, call_prefix: str | None = None) -> TurnResult:
    """``call_prefix``: the turn's, so calls parsed here have the ids they streamed with."""
    content, calls = tool_calls.parse(result.text, tool_calls.names_of(tools), call_prefix) if tools \
        else (result.text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    # a reply cut at max_tokens says so even when calls parsed before the cut (one may be missing)
    finish = "tool_calls" if calls and result.finish_reason != "length" else result.finish_reason
    return TurnResult(message, finish, result.timings, result.stop_sequence)


def prompt_counts(t: Timings) -> tuple[int, int, int]:
    """(prompt tokens, of them reused from cache, completion tokens): every protocol's usage."""
    return t.context_n, t.cache_n, t.predicted_n
