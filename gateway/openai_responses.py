"""The OpenAI Responses API: ``POST /v1/responses`` (plain and streamed),
``GET``/``DELETE /v1/responses/{id}`` and ``POST /v1/responses/input_tokens``.

``input`` items parse into the internal :class:`~gateway.protocol.ChatRequest`
(``message`` items as chat messages, ``function_call`` items as an assistant's
``tool_calls``, ``function_call_output`` items as ``role: tool``), with
``instructions`` as the system message.  A stored response (``store``, the
default) lives in a session the server makes for it: the response id names
that session, so ``previous_response_id`` continues the conversation *and its
KV* -- the follow-up sends only its new items and prefills only them -- on any
replica (the record is in Redis, under the caller's key, with the session's
TTL; another key's id is simply not found).  A session keeps its last
:data:`KEPT_RESPONSES` responses; server-made sessions are the first to go
when a key reaches its session cap.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from core.errors import InvalidRequest, SessionNotFound
from gateway import client_hints, keys, protocol, sse, tool_calls
from gateway import messages as wire
from gateway.auth import OWNER
from gateway.bodies import json_response, read_json
from gateway.error_responses import error_body
from gateway.protocol import ChatRequest, TurnResult
from gateway.tool_calls import CallArgs, CallStart
from gateway.turn_http import begin, complete
from gateway.turns import to_turn
from sessions.manager import IMPLICIT_PREFIX, Session

log = structlog.get_logger("specgate.http")
routes = web.RouteTableDef()
STORE_WAIT_S = 2.0
KEPT_RESPONSES = 16  # per conversation: what GET /v1/responses/{id} and previous_response_id can reach
_ID = re.compile(r"resp_([0-9a-f]{20})_[0-9a-f]{8}")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# the fields read here; the rest (reasoning, include, client_metadata, service_tier, truncation, ...) have
# no meaning on this server and are ignored with a debug log
KNOWN_FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "stream", "max_output_tokens",
                          "temperature", "top_p", "parallel_tool_calls", "text", "store", "metadata", "user",
                          "prompt_cache_key", "previous_response_id", "background", "conversation", "specprefill"})
ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "previous_response_id",
          "temperature", "top_p", "user", "prompt_cache_key")


@dataclass(slots=True, frozen=True)
class ResponsesRequest:
    chat: ChatRequest
    previous_response_id: str | None
    store: bool
    instructions: str | None
    echo: dict[str, Any]  # request fields a response object repeats back


# -- routes ----------------------------------------------------------------------
@routes.post("/v1/responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    session, history = await _continued(request, body)
    req = parse(body, request, history)
    if session is None and req.store and req.chat.session_id:  # kept apart from the named session, as ids say
        session = await request.app[keys.MANAGER].start_implicit(request[OWNER], required=True)
    turn = await begin(request, req.chat, session, keep=req.store)  # stored: kept so a follow-up continues it
    session = turn.session
    resp_id = new_id(session)
    model = req.chat.model or request.app[keys.CONFIG].gateway.model_name
    built = Builder(resp_id, model, req)
    if req.chat.stream:
        return await sse.stream(request, turn, ResponseEncoder(built, lambda r: _keep(request, session, r)))
    out = built.response(await complete(request, turn))
    await _keep(request, session, out)
    return json_response(out)


@routes.get("/v1/responses/{id}")
async def get_response(request: web.Request) -> web.Response:
    _, entry = await _stored(request, request.match_info["id"])
    return json_response(entry["body"])


@routes.delete("/v1/responses/{id}")
async def delete_response(request: web.Request) -> web.Response:
    resp_id = request.match_info["id"]
    session, _ = await _stored(request, resp_id)
    manager = request.app[keys.MANAGER]
    session.responses = [r for r in session.responses if r["id"] != resp_id]
    if session.responses or not session.implicit:
        manager.mirror(session)
    else:
        await manager.delete(session.owner, session.id)
    return json_response({"id": resp_id, "object": "response", "deleted": True})


@routes.post("/v1/responses/input_tokens")
async def input_tokens(request: web.Request) -> web.Response:
    body = await read_json(request)
    _, history = await _continued(request, body)
    req = parse(body, request, history)
    prompt = await request.app[keys.MANAGER].render(to_turn(req.chat, request[OWNER]), check=False)
    return json_response({"object": "response.input_tokens", "input_tokens": len(prompt.tokens)})


# -- conversations ---------------------------------------------------------------------
def new_id(session: Session | None) -> str:
    """``resp_<conversation>_<n>``: the id names the session that holds it (none: not stored)."""
    base = uuid.uuid4().hex[:20]
    if session is not None and session.id.startswith(IMPLICIT_PREFIX):
        base = session.id.removeprefix(IMPLICIT_PREFIX)
    return f"resp_{base}_{uuid.uuid4().hex[:8]}"


def session_id_of(resp_id: str) -> str:
    if not isinstance(resp_id, str) or not (m := _ID.fullmatch(resp_id)):
        raise SessionNotFound(f"response {resp_id!r} not found")
    return f"{IMPLICIT_PREFIX}{m.group(1)}"


async def _stored(request: web.Request, resp_id: str) -> tuple[Session, dict[str, Any]]:
    """The caller's session holding ``resp_id`` and its entry; 404 when there is none (another
    key's, deleted, expired or evicted responses alike)."""
    try:
        session = await request.app[keys.MANAGER].get(request[OWNER], session_id_of(resp_id))
    except SessionNotFound:
        raise SessionNotFound(f"response {resp_id!r} not found") from None
    for entry in session.responses:
        if entry["id"] == resp_id:
            return session, entry
    raise SessionNotFound(f"response {resp_id!r} not found")


async def _continued(request: web.Request, body: Any) -> tuple[Session | None, list[dict[str, Any]]]:
    """The session ``previous_response_id`` continues and the history up to that response
    (its instructions left out: a request's own instructions apply), or (None, [])."""
    if not isinstance(body, dict) or body.get("previous_response_id") is None:
        return None, []
    session, entry = await _stored(request, body["previous_response_id"])
    history = session.messages[: entry["n"]]
    return session, history[1:] if entry["instructions"] and history else history


async def _keep(request: web.Request, session: Session | None, response: dict[str, Any]) -> None:
    """Keep ``response`` in its conversation, in the store before the client hears of it (so
    any replica can continue it at once; a store that is down delays this by at most
    :data:`STORE_WAIT_S`).  A reply to an older response branches the history, so the
    responses after that one, which it no longer holds, are dropped."""
    if session is None:
        return
    prev = response.get("previous_response_id")
    upto = next((r["n"] for r in session.responses if r["id"] == prev), 0)
    kept = [r for r in session.responses if r["n"] <= upto]
    if response["store"] and response["status"] != "failed":
        entry = {"id": response["id"], "n": len(session.messages),
                 "instructions": bool(response.get("instructions")), "body": response}
        kept = [*kept, entry][-KEPT_RESPONSES:]
    session.responses = kept
    manager = request.app[keys.MANAGER]
    manager.mirror(session)
    if not await manager.stored(session, STORE_WAIT_S):
        log.warning("response_not_yet_stored", response_id=response["id"])


# -- parsing ---------------------------------------------------------------------------
def parse(body: Any, request: web.Request, history: list[dict[str, Any]]) -> ResponsesRequest:
    config = request.app[keys.CONFIG]
    return parse_body(body, history, request.app[keys.DEFAULTS], config.gateway.limits, config.engine.n_ctx,
                      client_hints.header_hint(request.headers))


def parse_body(body: Any, history: list[dict[str, Any]], defaults: Any, limits: Any, n_ctx: int,
               header_hint: str | None = None) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if ignored := sorted(set(body) - KNOWN_FIELDS):
        log.debug("fields_ignored", protocol="responses", fields=ignored)
    for key in ("background", "conversation"):
        if body.get(key):
            raise InvalidRequest(f"'{key}' is not supported by this server")
    fmt = body["text"].get("format") if isinstance(body.get("text"), dict) else None
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'instructions' must be a string")
    if "input" not in body:
        raise InvalidRequest("'input' is required: a string or a list of items")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history + items(body["input"])
    tools = wire.function_tools(body.get("tools"), lambda t: t.get("type") == "function", "parameters")
    chat_body = {"messages": messages, "tools": tools, "model": body.get("model"),
                 "tool_choice": _tool_choice(body.get("tool_choice")), "stream": body.get("stream"),
                 "max_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
                 "top_p": body.get("top_p"), "specprefill": body.get("specprefill"),
                 "parallel_tool_calls": body.get("parallel_tool_calls"), "response_format": _format(fmt),
                 "prompt_cache_key": body.get("prompt_cache_key"), "user": body.get("user")}
    chat = protocol.parse_chat({k: v for k, v in chat_body.items() if v is not None}, defaults, None, limits, n_ctx,
                               header_hint)
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16
                                     and all(isinstance(v, str) and len(v) <= 512 for v in metadata.values())):
        raise InvalidRequest("'metadata' must be an object of at most 16 string values (512 characters each)")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise InvalidRequest("'store' must be a boolean")
    echo = {k: body.get(k) for k in ECHOED} | {"tools": body.get("tools") or [], "format": fmt,
                                                "tool_choice": body.get("tool_choice", "auto")}
    return ResponsesRequest(chat, body.get("previous_response_id"), store, instructions, echo)


def items(raw: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise InvalidRequest("'input' must be a string or a list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            content = wire.join_text(item.get("content"), f"{where}.content", TEXT_PARTS)
            out.append({"role": item.get("role"), "content": content})
        elif kind == "function_call":
            _function_call(out, item, where)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequest(f"{where}.call_id must be a string")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": wire.join_text(item.get("output", ""), f"{where}.output", TEXT_PARTS)})
        elif kind == "reasoning":
            continue  # a reasoning model's own summary, sent back: nothing to render
        else:
            raise InvalidRequest(f"{where}.type {kind!r} is not supported; expected message, function_call or "
                                 "function_call_output")
    return out


def _function_call(out: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """A call joins the assistant message before it, as chat templates render one turn."""
    if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
        raise InvalidRequest(f"{where} must have string 'call_id' and 'name'")
    args = item.get("arguments", "{}")
    if not isinstance(args, str):
        raise InvalidRequest(f"{where}.arguments must be a JSON string")
    call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": args}}
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
        return
    out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _format(fmt: Any) -> Any:
    """``text.format`` in chat's ``response_format`` form (the schema sits one level up here)."""
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    return fmt


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidRequest("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}")


# -- rendering -------------------------------------------------------------------------
def failed_events(shell: dict[str, Any], seq: int, exc: BaseException) -> list[bytes]:
    """``error`` then ``response.failed`` (numbered from ``seq``): how a Responses stream ends
    when its turn fails after the stream started, here or on the replica it was relayed from."""
    status, body = error_body(exc)
    code, message = body["error"]["code"], body["error"]["message"]
    # a failed response's code is one of the API's own; SpecGate's code rides on the error event
    api_code = "rate_limit_exceeded" if status == 429 else "invalid_prompt" if status == 400 else "server_error"
    failed = {**shell, "status": "failed", "error": {"code": api_code, "message": message}}
    return [sse.frame({"type": "error", "sequence_number": seq, "code": code, "message": message, "param": None},
                      event="error"),
            sse.frame({"type": "response.failed", "sequence_number": seq + 1, "response": failed},
                      event="response.failed")]



class Builder:
    """One response's objects: its items, and the response object at each status."""

    def __init__(self, resp_id: str, model: str, req: ResponsesRequest) -> None:
        self.resp_id, self.model, self.req = resp_id, model, req
        self.created = int(time.time())
        self.msg_id = f"msg_{uuid.uuid4().hex[:24]}"

    def shell(self, status: str) -> dict[str, Any]:
        echo = self.req.echo
        return {"id": self.resp_id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": None, "model": self.model, "output": [],
                "parallel_tool_calls": echo["parallel_tool_calls"] is not False,
                "text": {"format": echo["format"] or {"type": "text"}}, "truncation": "disabled",
                "store": self.req.store,
                "reasoning": {"effort": None, "summary": None}, "usage": None,
                **{k: echo[k] for k in ECHOED if k != "parallel_tool_calls"},
                "metadata": echo["metadata"] or {}, "tools": echo["tools"], "tool_choice": echo["tool_choice"]}

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text
                or status != "completed" else []}

    @staticmethod
    def call_item(call: dict[str, Any]) -> dict[str, Any]:
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

    def output(self, result: TurnResult) -> list[dict[str, Any]]:
        text = result.message.get("content") or ""
        calls = [self.call_item(c) for c in result.tool_calls]
        return ([self.message_item(text)] if text or not calls else []) + calls

    def response(self, result: TurnResult) -> dict[str, Any]:
        incomplete = result.finish_reason == "length"
        prompt, cached, completion = protocol.prompt_counts(result.timings)
        return {**self.shell("incomplete" if incomplete else "completed"), "output": self.output(result),
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "usage": {"input_tokens": prompt,
                          "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                          "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": prompt + completion},
                "timings": result.timings.to_json()}


class ResponseEncoder:
    """The Responses event sequence, each event with its ``sequence_number``: created,
    in_progress, the message item's text deltas, one item per function call, completed."""

    def __init__(self, built: Builder, keep: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        self.b, self.keep = built, keep
        self.seq = 0
        self.said: list[str] | None = None  # the message item's text so far, once the item is open
        self.message_closed = False
        self.calls: dict[int, list[Any]] = {}  # streamed call still open -> [its item, arguments sent so far]
        self.closed: set[int] = set()  # calls whose items are done
        self.final: dict[str, Any] | None = None

    async def settle(self, result: TurnResult) -> None:
        """Store the response before ``response.completed`` tells the client its id."""
        self.final = self.response(result)
        await self.keep(self.final)

    def response(self, result: TurnResult) -> dict[str, Any]:
        response = self.b.response(result)
        if self.said is None and not result.tool_calls:  # an empty reply is still one message item
            response["output"] = [self.b.message_item("")]
        return response

    def _event(self, kind: str, **fields: Any) -> bytes:
        frame = sse.frame({"type": kind, "sequence_number": self.seq, **fields}, event=kind)
        self.seq += 1
        return frame

    def start(self) -> list[bytes]:
        return [self._event("response.created", response=self.b.shell("in_progress")),
                self._event("response.in_progress", response=self.b.shell("in_progress"))]

    def text(self, piece: str) -> list[bytes]:
        out = []
        part = {"item_id": self.b.msg_id, "output_index": 0, "content_index": 0}
        if self.said is None:
            self.said = []
            out += [self._event("response.output_item.added", output_index=0,
                                item=self.b.message_item("", "in_progress")),
                    self._event("response.content_part.added", **part,
                                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
        self.said.append(piece)
        return [*out, self._event("response.output_text.delta", **part, delta=piece, logprobs=[])]

    def _message_done(self, text: str) -> list[bytes]:
        """Close the message item (once): before a call's item opens, or at the end."""
        if self.said is None or self.message_closed:
            return []
        self.message_closed = True
        part = {"item_id": self.b.msg_id, "output_index": 0, "content_index": 0}
        item = self.b.message_item(text)
        return [self._event("response.output_text.done", **part, text=text, logprobs=[]),
                self._event("response.content_part.done", **part, part=item["content"][0]),
                self._event("response.output_item.done", output_index=0, item=item)]

    def _first_call_index(self) -> int:
        return 0 if self.said is None else 1

    def call(self, piece: CallStart | CallArgs) -> list[bytes]:
        if isinstance(piece, CallArgs):
            entry = self.calls[piece.index]
            entry[1] += piece.fragment
            return [self._event("response.function_call_arguments.delta", item_id=entry[0]["id"],
                                output_index=self._first_call_index() + piece.index, delta=piece.fragment)]
        out = self._message_done("".join(self.said or ()).strip())  # as the parsed reply's content will be
        for k in list(self.calls):  # items stream one after another: the call before this one is written
            item, sent = self.calls.pop(k)
            out += self._call_done(k, {**item, "arguments": sent})
        call = {"id": piece.id, "function": {"name": piece.name, "arguments": ""}}
        item = {**self.b.call_item(call), "status": "in_progress"}
        self.calls[piece.index] = [item, ""]
        return [*out, self._event("response.output_item.added", output_index=self._first_call_index() + piece.index,
                                  item=item)]

    def _call_done(self, k: int, item: dict[str, Any]) -> list[bytes]:
        self.closed.add(k)
        index, item = self._first_call_index() + k, {**item, "status": "completed"}
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def finish(self, result: TurnResult) -> list[bytes]:
        response = self.final or self.response(result)
        out = self._message_done(result.message.get("content") or "".join(self.said or ()))
        first = self._first_call_index()
        for k, call in enumerate(result.tool_calls):
            if k in self.closed:
                continue
            index, item = first + k, self.b.call_item(call)
            if k in self.calls:
                rest = tool_calls.unsent(item["arguments"], self.calls.pop(k)[1])
            else:
                out.append(self._event("response.output_item.added", output_index=index,
                                       item={**item, "arguments": "", "status": "in_progress"}))
                rest = item["arguments"]
            if rest:
                out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=index, delta=rest))
            out += self._call_done(k, item)
        # response.completed even when max_output_tokens cut it (status "incomplete"): the openai
        # and openai-agents clients take their final response only from that event
        return [*out, self._event("response.completed", response=response)]

    def error(self, exc: BaseException) -> list[bytes]:
        frames = failed_events(self.b.shell("failed"), self.seq, exc)
        self.seq += len(frames)
        return frames

    def keepalive(self) -> list[bytes]:
        return [sse.COMMENT]
