"""The OpenAI-compatible wire format: request parsing and response objects.

Parsing turns a JSON body into frozen, validated dataclasses (errors name the
offending field); builders turn engine results into completion objects,
stream chunks, ``usage`` and the extended llama.cpp-style ``timings``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, fields
from typing import Any

from core.config import PolicyConfig, SamplingParams, override
from core.engine import Result, Timings
from core.errors import ConfigError, InvalidRequest
from gateway import tool_calls

SAMPLING_KEYS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop")
UNSUPPORTED = ("grammar", "response_format", "logprobs", "top_logprobs", "logit_bias")
POLICY_KEYS = {f.name for f in fields(PolicyConfig)} - {"guard_keywords"}


@dataclass(slots=True, frozen=True)
class ChatRequest:
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    stream: bool
    include_usage: bool
    sampling: SamplingParams
    policy: PolicyConfig
    session_id: str | None
    model: str


def _typed(body: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
        raise InvalidRequest(f"'{key}' must be {what}")
    return value


def parse_sampling(body: dict[str, Any]) -> SamplingParams:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise InvalidRequest("'stop' must be a string or a list of strings")
    max_tokens = _typed(body, "max_completion_tokens", int, "an integer") or _typed(body, "max_tokens", int,
                                                                                    "an integer")
    values = {
        "max_tokens": max_tokens,
        "temperature": _typed(body, "temperature", (int, float), "a number"),
        "top_p": _typed(body, "top_p", (int, float), "a number"),
        "top_k": _typed(body, "top_k", int, "an integer"),
        "seed": _typed(body, "seed", int, "an integer"),
        "stop": tuple(stop) if stop else None,
    }
    return override(SamplingParams(), **values)


def parse_policy(base: PolicyConfig, raw: Any) -> PolicyConfig:
    """``specprefill``: a boolean (on/off) or an object of policy fields."""
    if raw is None:
        return base
    if isinstance(raw, bool):
        return override(base, enabled=raw)
    if not isinstance(raw, dict):
        raise InvalidRequest("'specprefill' must be a boolean or an object")
    unknown = set(raw) - POLICY_KEYS
    if unknown:
        raise InvalidRequest(f"unknown specprefill field(s) {sorted(unknown)}; known: {sorted(POLICY_KEYS)}")
    try:
        return override(base, **raw)
    except TypeError as exc:
        raise ConfigError(f"specprefill: {exc}") from exc


def parse_decoding(base: PolicyConfig, body: dict[str, Any]) -> PolicyConfig:
    """``speculative``: a boolean or {"gamma": int}; ``specattn``: a boolean or
    {"p": number, "gamma": int} (SpecAttn implies speculative decoding)."""
    policy = base
    for key, fields_ in (("speculative", {"gamma"}), ("specattn", {"gamma", "p"})):
        raw = body.get(key)
        if raw is None or isinstance(raw, bool):
            policy = override(policy, **{key: raw})
            continue
        if not isinstance(raw, dict):
            raise InvalidRequest(f"'{key}' must be a boolean or an object")
        if unknown := set(raw) - fields_:
            raise InvalidRequest(f"unknown {key} field(s) {sorted(unknown)}; known: {sorted(fields_)}")
        gamma = _typed(raw, "gamma", int, "an integer")
        p = _typed(raw, "p", (int, float), "a number")
        policy = override(policy, **{key: True}, gamma=gamma, specattn_p=p)
    return policy


def parse_tools(body: dict[str, Any]) -> tuple[dict[str, Any], ...] | None:
    tools = body.get("tools")
    if tools is None or body.get("tool_choice") == "none":
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                              and isinstance(t.get("function"), dict) for t in tools):
        raise InvalidRequest("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}")
    return tuple(tools) or None


def parse_chat(body: Any, base_policy: PolicyConfig, header_session: str | None,
               need_messages: bool = True) -> ChatRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for key in UNSUPPORTED:
        if body.get(key) is not None:
            raise InvalidRequest(f"'{key}' is not supported by this server")
    if body.get("n", 1) != 1:
        raise InvalidRequest("'n' must be 1")
    messages = body.get("messages")
    if need_messages and (not isinstance(messages, list) or not messages):
        raise InvalidRequest("'messages' must be a non-empty list")
    stream_options = _typed(body, "stream_options", dict, "an object") or {}
    session_id = header_session or _typed(body, "session_id", str, "a string")
    return ChatRequest(
        messages=tuple(tool_calls.for_template(m) if isinstance(m, dict) else m for m in messages or ()),
        tools=parse_tools(body),
        stream=bool(_typed(body, "stream", bool, "a boolean")),
        include_usage=bool(stream_options.get("include_usage")),
        sampling=parse_sampling(body),
        policy=parse_decoding(parse_policy(base_policy, body.get("specprefill")), body),
        session_id=session_id,
        model=str(body.get("model") or ""),
    )


# -- responses -----------------------------------------------------------------
def timings(t: Timings, rebuilt: bool = False) -> dict[str, Any]:
    prompt_s = t.prefill_ms / 1e3
    predicted_s = t.decode_ms / 1e3
    return {
        "specprefill": t.status, "specprefill_reason": t.reason, "position_mode": t.position_mode,
        "prompt_n": t.prompt_n, "prompt_ms": round(t.prefill_ms, 2),
        "prompt_per_second": round(t.prompt_n / prompt_s, 2) if prompt_s > 0 else None,
        "cache_n": t.cache_n, "spec_prefill_n": t.spec_prefill_n, "spec_cache_n": t.spec_cache_n,
        "kept_n": t.n_kept, "kept_runs": t.n_runs, "context_n": t.n_prompt,
        "spec_prefill_ms": round(t.spec_prefill_ms, 2), "lookahead_ms": round(t.lookahead_ms, 2),
        "scoring_ms": round(t.scoring_ms, 2), "prefill_ms": round(t.prefill_ms, 2),
        "ttft_ms": round(t.ttft_ms, 2), "predicted_n": t.n_predicted, "predicted_ms": round(t.decode_ms, 2),
        "predicted_per_second": round(t.n_predicted / predicted_s, 2) if predicted_s > 0 else None,
        "kv_rebuilt": rebuilt, **decoding_timings(t),
    }


def decoding_timings(t: Timings) -> dict[str, Any]:
    if t.decode_mode == "plain":
        return {"decode_mode": "plain"}
    s = t.spec
    return {
        "decode_mode": t.decode_mode, "draft_sync_ms": round(t.draft_sync_ms, 2),
        "draft_n": s.n_drafted, "draft_accepted_n": s.n_accepted, "draft_acceptance": round(s.accept_rate, 4),
        "kv_cells_attended": s.cells_attended, "kv_cells_total": s.cells_total,
        "kv_selected_fraction": round(s.selected_frac, 4),
        "draft_ms": round(s.draft_s * 1e3, 2), "verify_ms": round(s.verify_s * 1e3, 2),
    }


def usage(t: Timings) -> dict[str, Any]:
    return {"prompt_tokens": t.n_prompt, "completion_tokens": t.n_predicted,
            "total_tokens": t.n_prompt + t.n_predicted,
            "prompt_tokens_details": {"cached_tokens": t.cache_n}}


def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def finish_reason(result: Result, calls: list[dict[str, Any]]) -> str:
    if calls:
        return "tool_calls"
    return "length" if result.finish_reason == "length" else "stop"


def reply_message(text: str, tools: tuple[dict[str, Any], ...] | None) -> dict[str, Any]:
    """The assistant message for a reply: tool calls parsed out when tools were offered."""
    content, calls = tool_calls.parse(text, tool_calls.names_of(tools)) if tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


def completion(req_id: str, model: str, result: Result, tools: tuple[dict[str, Any], ...] | None,
               rebuilt: bool, session_id: str | None) -> dict[str, Any]:
    message = reply_message(result.text, tools)
    calls = message.get("tool_calls", [])
    body = {
        "id": req_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(result, calls),
                     "logprobs": None}],
        "usage": usage(result.timings), "timings": timings(result.timings, rebuilt),
    }
    if session_id:
        body["session_id"] = session_id
    return body


def chunk(req_id: str, model: str, delta: dict[str, Any], finish: str | None = None,
          **extra: Any) -> dict[str, Any]:
    return {"id": req_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
