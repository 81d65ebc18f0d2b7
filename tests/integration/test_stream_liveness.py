"""A prefill longer than a proxy's idle timeout keeps its stream alive: a real HAProxy with
``timeout server 1s`` in front of ``specgate serve`` (tiny models, keepalives every 0.25 s),
and a prompt whose prefill takes several times that.  Without the keepalives HAProxy would
cut the stream after 2 s of silence; with them every protocol's stream ends whole, and the
server log shows the prefill's progress.  (At full scale: ops/stream_liveness.py, a 60 s
timeout and a 14K-token Claude Code request on the real pair; results/agents.md.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support import ServerProcess, free_port

TIMEOUT_S = 1.0
KEEPALIVE_S = 0.25
# ~13.6K tokens: a dense prefill that outlasts 2 x TIMEOUT_S even on this kind's fastest machines (3-4x EPYC)
WORDS = "the build log shows a warning in module alpha then a retry in module beta " * 900


@pytest.fixture(scope="module")
def proxied(tiny_target: Path, tiny_speculator: Path, tmp_path_factory):
    if shutil.which("haproxy") is None:
        pytest.fail("haproxy not installed: run ops/test.sh, which installs it")
    server = ServerProcess(tiny_target, tiny_speculator, "--n-ctx", "16384", "--keepalive-s", str(KEEPALIVE_S),
                           "--stream-hold-s", str(KEEPALIVE_S),  # under the proxy's idle timeout
                           "--progress-log-s", "0.5", "--enabled", "false")  # dense: the slowest prefill
    port = free_port()
    cfg = tmp_path_factory.mktemp("haproxy") / "haproxy.cfg"
    cfg.write_text("defaults\n    mode http\n    timeout connect 5s\n    timeout client 60s\n"
                   f"    timeout server {int(TIMEOUT_S * 1000)}ms\n"
                   f"frontend f\n    bind 127.0.0.1:{port}\n    default_backend b\n"
                   f"backend b\n    server s1 127.0.0.1:{server.port}\n")
    proxy = subprocess.Popen(["haproxy", "-f", str(cfg)])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield base, server
    proxy.terminate()
    proxy.wait(10)
    server.stop()


def timed_stream(base: str, path: str, body: dict) -> list[tuple[float, str]]:
    """(seconds since the request, what arrived: an event name, 'data' or 'comment')."""
    arrivals: list[tuple[float, str]] = []
    t0 = time.monotonic()
    with httpx.stream("POST", base + path, json=body, timeout=httpx.Timeout(10, read=300)) as r:
        assert r.status_code == 200, r.read()
        event = None
        for line in r.iter_lines():
            if line.startswith(":"):
                arrivals.append((time.monotonic() - t0, "comment"))
            elif line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                arrivals.append((time.monotonic() - t0, event or line[6:][:20]))
                event = None
    return arrivals


@pytest.mark.parametrize("path, body, first, last, ping", [
    ("/v1/messages", {"model": "m", "max_tokens": 8, "stream": True,
                      "messages": [{"role": "user", "content": WORDS}]},
     "content_block_delta", "message_stop", "ping"),
    ("/v1/chat/completions", {"max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": WORDS}]},
     None, "[DONE]", "comment"),
    ("/v1/responses", {"max_output_tokens": 8, "stream": True, "store": False, "input": WORDS},
     "response.output_text.delta", "response.completed", "comment"),
])
def test_a_long_prefill_keeps_its_stream_alive_through_haproxy(proxied, path, body, first, last, ping):
    base, server = proxied
    fresh = f"Route {path}: "  # a prompt of its own: the others' KV must not serve it
    body = {**body, "messages": [{"role": "user", "content": fresh + WORDS}]} if "messages" in body \
        else {**body, "input": fresh + WORDS}
    arrivals = timed_stream(base, path, body)
    assert arrivals[-1][1] == last  # whole: HAProxy did not cut it
    assert arrivals[-1][0] > 2 * TIMEOUT_S  # and it ran well past the proxy's idle timeout
    gaps = [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert max(gaps) < TIMEOUT_S
    if first is not None:  # keepalives carried the prefill, before the first token
        first_at = next(t for t, kind in arrivals if kind == first)
        assert sum(1 for t, kind in arrivals if kind == ping and t < first_at) >= 3
    progress = [json.loads(line) for line in server.output().splitlines()
                if line.startswith("{") and '"prefill_progress"' in line]
    assert progress and all(p["done"] < p["total"] and p["eta_s"] is not None for p in progress)


@pytest.mark.parametrize("path, body, words", [
    ("/v1/messages", {"model": "m", "max_tokens": 8, "stream": True}, "prompt is too long: "),
    ("/v1/chat/completions", {"stream": True}, "maximum context length is 16383 tokens"),
    ("/v1/responses", {"stream": True, "store": False}, "maximum context length is 16383 tokens"),
])
def test_a_streamed_prompt_over_the_context_is_a_400_before_any_stream(proxied, path, body, words):
    _, server = proxied
    text = WORDS * 2  # ~27K tokens against a 16K context
    payload = {**body, "input": text} if path == "/v1/responses" else \
        {**body, "messages": [{"role": "user", "content": text}]}
    r = httpx.post(server.base + path, json=payload, timeout=60)
    assert r.status_code == 400 and r.headers["Content-Type"].startswith("application/json"), r.text[:300]
    error = r.json()["error"]
    assert words in error["message"]
    if path == "/v1/messages":
        assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"
        assert error["message"].endswith("tokens > 16383 maximum")
    else:
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
