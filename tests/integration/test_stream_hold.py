"""A stream's headers wait for its first token (``--stream-hold-s``): until then nothing has
been answered, so a balancer can replay the request on another replica if this one dies
(tests/integration/test_cluster.py kills one under HAProxy), and a turn that fails first gets
its error's own status instead of a stream.  The in-process gateway, tiny models, the default
hold (50 s) and keepalives every 50 ms: a stream that opened at once would show keepalives
through the prefill."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.support import ModelThreadHeld, start_gateway, until

# ~2.5K tokens, prefilled densely: a turn that stays in its prefill for a while
LONG = "Count to a thousand." + " The pump log lists flow, pressure and temperature." * 230


@pytest.fixture(scope="module")
def gw(tiny_target, tiny_speculator):
    server = start_gateway(tiny_target, tiny_speculator, keepalive_s=0.05, engine={"slots": 1})
    yield server
    server.stop()


def body(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "stream": True,
            "specprefill": False, **extra}


def running(gw) -> float:
    text = httpx.get(gw.base + "/metrics", timeout=10).text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("specgate_running_turns "))


def test_no_keepalive_precedes_the_first_token_while_headers_are_held(gw):
    with httpx.stream("POST", gw.base + "/v1/chat/completions", json=body(LONG), timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[0].startswith("data: ") and '"role":"assistant"' in lines[0], lines[:3]
    first_text = next(i for i, line in enumerate(lines) if '"content":"' in line and '"role"' not in line)
    assert ": keepalive" not in lines[:first_text]  # the prefill ran before any byte went out
    assert lines[-1] == "data: [DONE]"


def test_a_turn_that_fails_before_its_first_token_gets_its_status_not_a_stream(gw):
    """The session is deleted while its turn prefills: the client gets a 499 ``cancelled``
    error body (JSON), where an opened stream would have carried it in-band."""
    assert httpx.post(gw.base + "/v1/chat/completions", headers={"X-SpecGate-Session": "gone-1"}, timeout=60,
                      json={**body("Hi."), "stream": False}).status_code == 200
    out: list[httpx.Response] = []

    def go() -> None:
        with httpx.stream("POST", gw.base + "/v1/chat/completions", headers={"X-SpecGate-Session": "gone-1"},
                          json=body("Again. " + LONG, max_tokens=200), timeout=120) as r:
            r.read()
            out.append(r)

    client = threading.Thread(target=go)
    client.start()
    assert until(lambda: running(gw) >= 1)
    with ModelThreadHeld(gw):  # the turn stays in its prefill while the session goes
        assert httpx.delete(gw.base + "/v1/sessions/gone-1", timeout=30).status_code == 200
    client.join(120)
    r = out[0]
    assert r.status_code == 499 and r.headers["Content-Type"].startswith("application/json"), r.text[:300]
    assert r.json()["error"]["code"] == "cancelled"
