"""Record what real agent clients send: a stand-in server that answers each protocol with a
short, valid streamed reply and writes every request (method, path, headers, body) to a folder.

    python ops/record_clients.py DIR [--port 8099]

Point Claude Code (ANTHROPIC_BASE_URL), Codex (a provider's base_url, .../v1) or opencode
(an openai-compatible provider's baseURL, .../v1) at it; the recordings become test fixtures
(tests/fixtures/clients/).  Standard library only, so it runs before SpecGate is set up.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPLY = "Done."
_count = itertools.count(1)
_lock = threading.Lock()


def sse(event: str | None, data: Any) -> bytes:
    head = f"event: {event}\n" if event else ""
    payload = data if isinstance(data, str) else json.dumps(data)
    return f"{head}data: {payload}\n\n".encode()


def anthropic_stream(model: str) -> list[bytes]:
    msg: dict[str, Any] = {"id": "msg_rec", "type": "message", "role": "assistant", "model": model, "content": [],
           "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 0}}
    events = [("message_start", {"type": "message_start", "message": msg}),
              ("content_block_start", {"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "text", "text": ""}}),
              ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": REPLY}}),
              ("content_block_stop", {"type": "content_block_stop", "index": 0}),
              ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                 "usage": {"output_tokens": 2}}),
              ("message_stop", {"type": "message_stop"})]
    return [sse(k, v) for k, v in events]


def anthropic_message(model: str) -> dict[str, Any]:
    return {"id": "msg_rec", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": REPLY}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 2}}


def responses_stream(model: str) -> list[bytes]:
    base = {"id": "resp_rec", "object": "response", "created_at": int(time.time()), "model": model,
            "status": "in_progress", "output": [], "usage": None}
    item: dict[str, Any] = {"type": "message", "id": "msg_rec", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": REPLY, "annotations": []}]}
    done = {**base, "status": "completed", "output": [item],
            "usage": {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}
    events: list[dict[str, Any]] = [{"type": "response.created", "response": base},
              {"type": "response.output_item.added", "output_index": 0, "item": {**item, "status": "in_progress",
                                                                                 "content": []}},
              {"type": "response.output_text.delta", "item_id": "msg_rec", "output_index": 0, "content_index": 0,
               "delta": REPLY},
              {"type": "response.output_item.done", "output_index": 0, "item": item},
              {"type": "response.completed", "response": done}]
    return [sse(e["type"], {**e, "sequence_number": i}) for i, e in enumerate(events)]


def chat_stream(model: str) -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "chatcmpl-rec", "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    usage = {**chunk({}), "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    return [sse(None, chunk({"role": "assistant", "content": REPLY})), sse(None, chunk({}, "stop")),
            sse(None, usage), sse(None, "[DONE]")]


class Recorder(BaseHTTPRequestHandler):
    out: Path

    def log_message(self, *args: Any) -> None:  # quiet: the recordings are the log
        return None

    def _record(self, body: Any) -> None:
        with _lock:
            n = next(_count)
        entry = {"method": self.command, "path": self.path, "headers": dict(self.headers.items()), "body": body}
        (self.out / f"{n:03d}.json").write_text(json.dumps(entry, indent=1))

    def _send(self, status: int, payload: Any = None, frames: list[bytes] | None = None) -> None:
        self.send_response(status)
        if frames is not None:
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for f in frames:
                self.wfile.write(f)
            return
        data = json.dumps(payload).encode()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 -- http.server's naming
        self._record(None)
        if self.path.rstrip("/").endswith("/models"):
            self._send(200, {"object": "list", "data": [{"id": "specgate", "object": "model", "owned_by": "rec"}]})
        else:
            self._send(404, {"error": {"message": "not recorded", "type": "invalid_request_error"}})

    def do_POST(self) -> None:  # noqa: N802
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            body = raw.decode(errors="replace")
        self._record(body)
        model = body.get("model", "specgate") if isinstance(body, dict) else "specgate"
        stream = isinstance(body, dict) and bool(body.get("stream"))
        path = self.path.split("?")[0]
        if path.endswith("/messages/count_tokens"):
            self._send(200, {"input_tokens": 1})
        elif path.endswith("/messages"):
            self._send(200, frames=anthropic_stream(model)) if stream else self._send(200, anthropic_message(model))
        elif path.endswith("/responses"):
            self._send(200, frames=responses_stream(model))
        elif path.endswith("/chat/completions"):
            self._send(200, frames=chat_stream(model))
        else:
            self._send(404, {"error": {"message": "not recorded", "type": "invalid_request_error"}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--port", type=int, default=8099)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    Recorder.out = args.out
    ThreadingHTTPServer(("127.0.0.1", args.port), Recorder).serve_forever()


if __name__ == "__main__":
    main()
