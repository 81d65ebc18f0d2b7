"""A finished Responses turn as a ``response`` object, or as its event stream
(``response.created`` ... ``response.completed``, or ``response.failed``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from gateway import chat_request, sse, tool_calls
from gateway.chat_request import TurnResult
from gateway.error_responses import error_body
from gateway.tool_calls import CallArgs, CallStart
from gateway.wire.openai_responses.parse import ECHOED, ResponsesRequest


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
        prompt, cached, completion = chat_request.prompt_counts(result.timings)
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
