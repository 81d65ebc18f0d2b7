"""A finished chat turn streamed as ``chat.completion.chunk`` events closed by
``data: [DONE]``."""

from __future__ import annotations

from gateway import sse
from gateway.chat_request import TurnResult
from gateway.error_responses import error_body
from gateway.tool_calls import CallArgs, CallStart
from gateway.wire.openai_chat.objects import chunk, final_chunks


class ChunkEncoder:
    """``chat.completion.chunk`` events: the role, content pieces, the closing chunks, ``[DONE]``."""

    def __init__(self, req_id: str, model: str, session_id: str | None, include_usage: bool) -> None:
        self.req_id, self.model, self.session_id, self.include_usage = req_id, model, session_id, include_usage
        self.streamed: dict[int, str] = {}  # each streamed call's arguments sent so far

    async def settle(self, result: TurnResult) -> None:
        return None

    def start(self) -> list[bytes]:
        return [sse.frame(chunk(self.req_id, self.model, {"role": "assistant", "content": ""}))]

    def text(self, piece: str) -> list[bytes]:
        return [sse.frame(chunk(self.req_id, self.model, {"content": piece}))]

    def call(self, piece: CallStart | CallArgs) -> list[bytes]:
        """A call's id and name when it starts, then its arguments in pieces, as OpenAI streams them."""
        if isinstance(piece, CallStart):
            self.streamed[piece.index] = ""
            delta = {"index": piece.index, "id": piece.id, "type": "function",
                     "function": {"name": piece.name, "arguments": ""}}
        else:
            self.streamed[piece.index] += piece.fragment
            delta = {"index": piece.index, "function": {"arguments": piece.fragment}}
        return [sse.frame(chunk(self.req_id, self.model, {"tool_calls": [delta]}))]

    def finish(self, result: TurnResult) -> list[bytes]:
        return [*(sse.frame(c) for c in final_chunks(self.req_id, self.model, result, self.session_id,
                                                     self.include_usage, self.streamed)), sse.frame("[DONE]")]

    def keepalive(self) -> list[bytes]:
        return [sse.COMMENT]

    def error(self, exc: BaseException) -> list[bytes]:
        return [sse.frame(error_body(exc)[1]), sse.frame("[DONE]")]
