"""Requests that name no session, as agent frameworks send them (the whole history every
time): the gateway finds the conversation by its tokens and reuses its KV.  Tiny models,
a real redis-server, two API keys, one slot (a second conversation parks the first)."""

from __future__ import annotations

import uuid

import httpx
import pytest

from core.config import Limits
from tests.support import start_gateway

pytestmark = [pytest.mark.models, pytest.mark.redis]
ALICE, BOB = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def doc(tag: str) -> str:
    return " ".join(f"{tag} line {k}: pump {k % 4} ran {k * 3 + 5} minutes." for k in range(14))


def start(tag: str) -> list[dict]:
    return [{"role": "system", "content": "You read logs for an operator."},
            {"role": "user", "content": f"Summarize {tag}."},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "read_file", "arguments": '{"path": "' + tag + '.log"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": doc(tag)}]


@pytest.fixture(scope="module")
def gw(tiny_target, tiny_speculator, redis_server, tmp_path_factory):
    server = start_gateway(tiny_target, tiny_speculator, redis_url=redis_server.url, api_keys=("sk-alice", "sk-bob"),
                           kv_budget_mb=0, kv_spill_dir=str(tmp_path_factory.mktemp("spill")), engine={"slots": 1},
                           limits=Limits(max_sessions_per_key=3))
    yield server
    server.stop()


def send(gw, messages: list[dict], headers=ALICE, **extra) -> httpx.Response:
    r = httpx.post(gw.base + "/v1/chat/completions", headers=headers, timeout=120,
                   json={"messages": messages, "tools": TOOLS, "max_tokens": 6, **extra})
    assert r.status_code == 200, r.text
    return r


def turn(gw, messages: list[dict], text: str, headers=ALICE) -> tuple[httpx.Response, list[dict]]:
    """Send the history plus ``text``, as a framework does; returns the reply and the history
    with both appended (the reply as the client copies it back)."""
    history = [*messages, {"role": "user", "content": text}]
    r = send(gw, history, headers)
    return r, [*history, r.json()["choices"][0]["message"]]


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def prompt(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens"]


def metric(gw, name: str) -> float:
    text = httpx.get(gw.base + "/metrics").text
    return float(text.split(f"\n{name} ")[1].split()[0])


def test_a_resent_history_continues_its_conversation_turn_after_turn(gw):
    tag = f"a{uuid.uuid4().hex[:6]}"
    r1, h = turn(gw, start(tag), "Go on.")
    sid = r1.headers["X-SpecGate-Session"]
    assert sid.startswith("conv-") and r1.headers["X-SpecGate-Session-Implicit"] == "1"
    hits = metric(gw, "specgate_implicit_hits_total")
    r2, h = turn(gw, h, "And pump 2?")
    r3, h = turn(gw, h, "And pump 3?")
    assert r2.headers["X-SpecGate-Session"] == r3.headers["X-SpecGate-Session"] == sid
    assert cached(r2) >= prompt(r1) and cached(r3) >= prompt(r2)  # each turn reused all of the last prompt
    assert metric(gw, "specgate_implicit_hits_total") == hits + 2
    meta = httpx.get(f"{gw.base}/v1/sessions/{sid}", headers=ALICE).json()
    assert meta["implicit"] and meta["turns"] == 3 and meta["messages"] == len(h)


def test_a_branch_forks_and_leaves_the_original_intact(gw):
    tag = f"b{uuid.uuid4().hex[:6]}"
    r1, h1 = turn(gw, start(tag), "Go on.")
    r2, h2 = turn(gw, h1, "And pump 2?")
    original = r1.headers["X-SpecGate-Session"]
    assert r2.headers["X-SpecGate-Session"] == original
    rb, hb = turn(gw, h1, "Which pump ran least?")  # the same history up to r1, then another question
    branch = rb.headers["X-SpecGate-Session"]
    assert branch != original
    r3, h3 = turn(gw, h2, "And pump 3?")  # the original goes on where it was
    assert r3.headers["X-SpecGate-Session"] == original and cached(r3) >= prompt(r2)
    rb2, _ = turn(gw, hb, "Why?")
    assert rb2.headers["X-SpecGate-Session"] == branch and cached(rb2) >= prompt(rb)
    assert httpx.get(f"{gw.base}/v1/sessions/{original}", headers=ALICE).json()["messages"] == len(h3)


def test_another_key_never_reuses_a_conversation(gw):
    tag = f"c{uuid.uuid4().hex[:6]}"
    r1, h = turn(gw, start(tag), "Go on.")
    rb, _ = turn(gw, h, "And pump 2?", headers=BOB)  # Bob sends Alice's exact conversation
    assert rb.headers["X-SpecGate-Session"] != r1.headers["X-SpecGate-Session"] and cached(rb) == 0
    assert httpx.get(f"{gw.base}/v1/sessions/{r1.headers['X-SpecGate-Session']}", headers=BOB).status_code == 404


def test_a_spilled_conversation_is_found_again(gw):
    """One slot and no RAM budget: a second conversation spills the first one's KV to disk."""
    r1, h = turn(gw, start(f"d{uuid.uuid4().hex[:6]}"), "Go on.")
    other = send(gw, [*start(f"e{uuid.uuid4().hex[:6]}"), {"role": "user", "content": "Go on."}])
    assert other.headers["X-SpecGate-Session"] != r1.headers["X-SpecGate-Session"]
    meta = httpx.get(f"{gw.base}/v1/sessions/{r1.headers['X-SpecGate-Session']}", headers=ALICE).json()
    assert meta["kv"] == "disk"
    r2, _ = turn(gw, h, "And pump 2?")
    assert r2.headers["X-SpecGate-Session"] == r1.headers["X-SpecGate-Session"] and cached(r2) >= prompt(r1)


def test_a_flood_evicts_implicit_sessions_first_and_never_fails(gw):
    """Three sessions per key: unrelated requests take the room of the oldest implicit
    sessions, never of a named one, and with no room left run without a session."""
    named = [f"named-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    for sid in named:
        send(gw, [{"role": "user", "content": "Hi."}], headers={**BOB, "X-SpecGate-Session": sid})
    seen = [send(gw, [*start(f"f{i}{uuid.uuid4().hex[:6]}"), {"role": "user", "content": "Go on."}],
                 headers=BOB).headers["X-SpecGate-Session"] for i in range(3)]
    assert len(set(seen)) == 3
    status = [httpx.get(f"{gw.base}/v1/sessions/{sid}", headers=BOB).status_code for sid in [*named, *seen]]
    assert status == [200, 200, 404, 404, 200]  # the newest implicit one holds the key's last seat
    assert httpx.post(gw.base + "/v1/sessions", headers=BOB, json={}).status_code == 201  # a named one evicts it
    assert httpx.get(f"{gw.base}/v1/sessions/{seen[-1]}", headers=BOB).status_code == 404
    r = send(gw, [*start("g"), {"role": "user", "content": "Go on."}], headers=BOB)  # no room: served stateless
    assert "X-SpecGate-Session" not in r.headers and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_cache_key_narrows_which_conversation_continues(gw):
    """``prompt_cache_key`` groups a client's requests: the same history under another key
    starts its own conversation; under its own it continues, as tokens match."""
    history = [*start(f"h{uuid.uuid4().hex[:6]}"), {"role": "user", "content": "Go on."}]
    r1 = send(gw, history, prompt_cache_key="agent-1")
    follow = [*history, r1.json()["choices"][0]["message"], {"role": "user", "content": "And pump 2?"}]
    other = send(gw, follow, prompt_cache_key="agent-2")
    assert other.headers["X-SpecGate-Session"] != r1.headers["X-SpecGate-Session"]
    mine = send(gw, follow, prompt_cache_key="agent-1")
    assert mine.headers["X-SpecGate-Session"] == r1.headers["X-SpecGate-Session"] and cached(mine) >= prompt(r1)
    bad = httpx.post(gw.base + "/v1/chat/completions", headers=ALICE, timeout=30,
                     json={"messages": history, "max_tokens": 2, "prompt_cache_key": 7})
    assert bad.status_code == 400 and "prompt_cache_key" in bad.json()["error"]["message"]
