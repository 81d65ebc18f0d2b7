"""The Anthropic Messages API: ``POST /v1/messages`` (plain and streamed) and
``POST /v1/messages/count_tokens``.

A body parses into the internal :class:`~gateway.protocol.ChatRequest`:
``system`` becomes a system message, ``text`` blocks content, ``tool_use``
blocks an assistant's ``tool_calls`` (arguments as JSON), ``tool_result``
blocks ``role: tool`` messages, and ``tools``' ``input_schema`` a function's
``parameters``.  The finished turn renders as a ``message`` object, or as the
``message_start`` ... ``message_stop`` event sequence.  Errors on these routes
take Anthropic's shape (see :mod:`gateway.error_responses`); ``cache_control`` is
accepted and ignored, since SpecGate keeps every session's KV anyway, and
reuse is reported as ``usage.cache_read_input_tokens``.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import structlog
from aiohttp import web

from core.config import DEFAULT_LIMITS, Limits
from core.errors import InvalidRequest
from core.policies import TurnParams
from gateway import client_hints, keys, protocol, sse, tool_calls
from gateway import messages as wire
from gateway.auth import OWNER
from gateway.bodies import json_response, read_json
from gateway.error_responses import anthropic_body
from gateway.protocol import ChatRequest, TurnResult
from gateway.tool_calls import CallArgs, CallStart
from gateway.turn_http import begin, complete, session_headers
from gateway.turns import to_turn

log = structlog.get_logger("specgate.http")
routes = web.RouteTableDef()
# a model's own reasoning sent back, and server-tool blocks (run by Anthropic's servers, not here): not rendered
IGNORED_BLOCKS = ("thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result",
                  "web_fetch_tool_result", "code_execution_tool_result", "container_upload")
# the fields read here; the rest (thinking, context_management, output_config, service_tier, container,
# mcp_servers, betas, ...) have no meaning on this server and are ignored with a debug log
KNOWN_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "max_tokens", "stream",
                          "temperature", "top_p", "top_k", "stop_sequences", "metadata", "session_id", "specprefill"})
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}


@routes.post("/v1/messages")
async def create_message(request: web.Request) -> web.StreamResponse:
    req = parse(await read_json(request), request)
    turn = await begin(request, req)
    model = req.model or request.app[keys.CONFIG].gateway.model_name
    headers = session_headers(turn)
    if req.stream:
        return await sse.stream(request, turn, MessageEncoder(new_id(), model), headers)
    return json_response(message(new_id(), model, await complete(request, turn)), headers=headers)


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    body = await read_json(request)
    if isinstance(body, dict):
        body = {**body, "max_tokens": 1}  # count_tokens takes no max_tokens
    req = parse(body, request)
    prompt = await request.app[keys.MANAGER].render(to_turn(req, request[OWNER]), check=False)
    return json_response({"input_tokens": len(prompt.tokens)})


def parse(body: Any, request: web.Request) -> ChatRequest:
    config = request.app[keys.CONFIG]
    return parse_messages_body(body, request.app[keys.DEFAULTS], request.headers.get(client_hints.SESSION_HEADER),
                               config.gateway.limits, config.engine.n_ctx, client_hints.header_hint(request.headers),
                               config.gateway.keep_billing_header)


def parse_messages_body(body: Any, defaults: TurnParams, header_session: str | None,
                        limits: Limits = DEFAULT_LIMITS, n_ctx: int = 8192, header_hint: str | None = None,
                        keep_billing: bool = False) -> ChatRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise InvalidRequest("'max_tokens' is required and must be an integer")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'messages' must be a non-empty list")
    if ignored := sorted(set(body) - KNOWN_FIELDS):
        log.debug("fields_ignored", protocol="anthropic", fields=ignored)
    system = _system(body.get("system"), keep_billing)
    chat: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(raw):
        chat += _message(m, f"messages[{i}]")
    tools = wire.function_tools(body.get("tools"), _runnable, "input_schema")
    choice = _tool_choice(body.get("tool_choice"))
    chat_body = {
        "messages": chat, "tools": tools, "tool_choice": choice, "model": body.get("model"),
        "stream": body.get("stream"), "max_tokens": body["max_tokens"], "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "top_k": body.get("top_k"), "stop": body.get("stop_sequences"),
        "session_id": body.get("session_id"), "specprefill": body.get("specprefill"),
        "user": client_hints.anthropic_user_hint(_user_id(body.get("metadata"))),
        "parallel_tool_calls": False if isinstance(body.get("tool_choice"), dict)
        and body["tool_choice"].get("disable_parallel_tool_use") is True else None,
    }
    return protocol.parse_chat({k: v for k, v in chat_body.items() if v is not None}, defaults, header_session,
                               limits, n_ctx, header_hint)


def _runnable(tool: dict[str, Any]) -> bool:
    """A client-side tool the model may call now: not a server tool (web search, code
    execution: no ``input_schema``), nor one deferred until a tool search loads it."""
    return "input_schema" in tool and tool.get("defer_loading") is not True


def _user_id(metadata: Any) -> Any:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise InvalidRequest("'metadata' must be an object")
    return metadata.get("user_id")


def _system(system: Any, keep_billing: bool) -> str:
    """The system prompt, without Claude Code's leading billing line unless kept."""
    if not system:
        return ""
    text = wire.join_text(system, "system")
    if keep_billing:
        return text
    if isinstance(system, list) and system and isinstance(system[0], dict):  # the line is the first block
        first, found = client_hints.strip_billing_line(system[0].get("text") or "")
        text = wire.join_text([{**system[0], "text": first}, *system[1:]], "system") if found else text
    else:
        text, found = client_hints.strip_billing_line(text)
    if found:
        log.debug("billing_line_stripped")
    return text


def _message(m: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages: tool results become ``role: tool``; a
    ``system`` entry (Claude Code's environment context) stays where it is in the conversation
    (core.chat folds it into the system prompt when the template cannot place it there)."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
        raise InvalidRequest(f"{where} must be an object with role 'user', 'assistant' or 'system'")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of content blocks")
    out: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for k, block in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise InvalidRequest(f"{at}.tool_use_id must be a string")
            result = block.get("content", "")
            body = wire.join_text(result, f"{at}.content") if result else ""
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": f"Error: {body}" if block.get("is_error") else body})
        elif kind in wire.UNREADABLE:
            text.append(wire.placeholder(kind))
        elif kind in IGNORED_BLOCKS:
            continue
        else:
            raise InvalidRequest(f"{at} must be a text, tool_use (assistant) or tool_result (user) block, "
                                 f"got {kind!r}")
    if text or calls or not out:
        msg: dict[str, Any] = {"role": role, "content": "".join(text) if text or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
        raise InvalidRequest(f"{where} must have string 'id' and 'name'")
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise InvalidRequest(f"{where}.input must be an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": orjson.dumps(args).decode()}}


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidRequest("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")


# -- responses -----------------------------------------------------------------
def new_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def stop_reason(result: TurnResult) -> str:
    if result.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(result.finish_reason, "end_turn")


def usage(result: TurnResult) -> dict[str, int]:
    prompt, cached, completion = protocol.prompt_counts(result.timings)
    return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def content_blocks(result: TurnResult) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if text := result.message.get("content"):
        blocks.append({"type": "text", "text": text})
    for call in result.tool_calls:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": _arguments(call)})
    return blocks


def _arguments(call: dict[str, Any]) -> dict[str, Any]:
    try:
        args = orjson.loads(call["function"]["arguments"] or "{}")
    except orjson.JSONDecodeError:
        return {}
    return args if isinstance(args, dict) else {}


def message(msg_id: str, model: str, result: TurnResult) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(result), "stop_reason": stop_reason(result),
            "stop_sequence": result.stop_sequence, "usage": usage(result),
            "timings": result.timings.to_json()}


class MessageEncoder:
    """``message_start``, a text block's deltas, one ``tool_use`` block per call (its input as
    ``input_json_delta`` pieces while the model writes it), ``message_delta`` with the stop
    reason, ``message_stop``."""

    def __init__(self, msg_id: str, model: str) -> None:
        self.msg_id, self.model = msg_id, model
        self.blocks = 0  # blocks opened so far
        self.text_open = False
        self.calls: dict[int, list[Any]] = {}  # streamed call still open -> [its block index, input sent so far]
        self.closed: set[int] = set()  # streamed calls whose blocks are stopped

    def _event(self, kind: str, **fields: Any) -> bytes:
        return sse.frame({"type": kind, **fields}, event=kind)

    async def settle(self, result: TurnResult) -> None:
        return None

    def start(self) -> list[bytes]:
        shell: dict[str, Any] = {
            "id": self.msg_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [self._event("message_start", message=shell), self._event("ping")]

    def text(self, piece: str) -> list[bytes]:
        out = []
        if not self.text_open:
            out.append(self._event("content_block_start", index=self.blocks,
                                   content_block={"type": "text", "text": ""}))
            self.text_open, self.blocks = True, self.blocks + 1
        out.append(self._event("content_block_delta", index=self.blocks - 1,
                               delta={"type": "text_delta", "text": piece}))
        return out

    def _close_text(self) -> list[bytes]:
        if not self.text_open:
            return []
        self.text_open = False
        return [self._event("content_block_stop", index=self.blocks - 1)]

    def _open_call(self, call_id: str, name: str) -> tuple[int, bytes]:
        i, self.blocks = self.blocks, self.blocks + 1
        return i, self._event("content_block_start", index=i,
                              content_block={"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def _input(self, block: int, partial: str) -> bytes:
        return self._event("content_block_delta", index=block, delta={"type": "input_json_delta",
                                                                      "partial_json": partial})

    def call(self, piece: CallStart | CallArgs) -> list[bytes]:
        if isinstance(piece, CallStart):
            out = self._close_text()
            for k in list(self.calls):  # blocks stream one after another: the call before this one is written
                self.closed.add(k)
                out.append(self._event("content_block_stop", index=self.calls.pop(k)[0]))
            block, start = self._open_call(piece.id, piece.name)
            self.calls[piece.index] = [block, ""]
            return [*out, start]
        entry = self.calls[piece.index]
        entry[1] += piece.fragment
        return [self._input(entry[0], piece.fragment)]

    def finish(self, result: TurnResult) -> list[bytes]:
        out = self._close_text()
        for k, call in enumerate(result.tool_calls):
            if k in self.closed:
                continue
            arguments = orjson.dumps(_arguments(call)).decode()
            if k in self.calls:
                block, sent = self.calls.pop(k)
                rest = tool_calls.unsent(call["function"]["arguments"], sent) if sent else arguments
            else:
                block, start = self._open_call(call["id"], call["function"]["name"])
                out.append(start)
                rest = arguments
            out += [*([self._input(block, rest)] if rest else []), self._event("content_block_stop", index=block)]
        out += [self._event("content_block_stop", index=block) for block, _ in self.calls.values()]  # unparsed
        out += [self._event("message_delta", delta={"stop_reason": stop_reason(result),
                                                    "stop_sequence": result.stop_sequence},
                            usage=usage(result), timings=result.timings.to_json()),
                self._event("message_stop")]
        return out

    def keepalive(self) -> list[bytes]:
        return [self._event("ping")]

    def error(self, exc: BaseException) -> list[bytes]:
        return [sse.frame(anthropic_body(exc)[1], event="error")]
