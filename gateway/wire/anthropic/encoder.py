"""A finished Anthropic turn as a ``message`` object, or as the ``message_start`` ...
``message_stop`` event sequence.  Errors on these routes take Anthropic's shape (see
:mod:`gateway.error_responses`)."""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from gateway import chat_request, sse, tool_calls
from gateway.chat_request import TurnResult
from gateway.error_responses import anthropic_body
from gateway.tool_calls import CallArgs, CallStart

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def stop_reason(result: TurnResult) -> str:
    if result.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(result.finish_reason, "end_turn")


def usage(result: TurnResult) -> dict[str, int]:
    prompt, cached, completion = chat_request.prompt_counts(result.timings)
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
