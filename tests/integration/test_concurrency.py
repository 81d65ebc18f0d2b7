"""Several sessions at once through the gateway: turns share the step loop's batches,
a client that leaves frees its slot, and a deleted session's slot never leaks its KV."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from tests.support import start_gateway

COUNT = [{"role": "user", "content": "Count slowly from one to fifty, one number per line."}]


@pytest.fixture(scope="module")
def gw(tiny_target, tiny_speculator):
    # mixed steps (16-token prefill chunks beside decoding turns), so that streams which start
    # together also decode together; the default, decode first, holds a prefill while others decode
    server = start_gateway(tiny_target, tiny_speculator, engine={"slots": 4, "step_tokens": 16})
    yield server
    server.stop()


def stream_times(base: str, sid: str, out: dict[str, list[float]], max_tokens: int = 40) -> None:
    times: list[float] = []
    with httpx.stream("POST", base + "/v1/chat/completions", headers={"X-SpecGate-Session": sid}, timeout=300,
                      json={"messages": COUNT, "max_tokens": max_tokens, "stream": True}) as resp:
        for line in resp.iter_lines():
            if '"content"' in line and '"role"' not in line:
                times.append(time.perf_counter())
    out[sid] = times


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics").text
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_three_sessions_stream_at_the_same_time_in_shared_batches(gw):
    rows0, batches0 = metric(gw.base, "specgate_step_batch_rows_total"), metric(gw.base, "specgate_step_batches_total")
    out: dict[str, list[float]] = {}
    threads = [threading.Thread(target=stream_times, args=(gw.base, f"conc-{i}", out)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(len(t) >= 10 for t in out.values()), {k: len(v) for k, v in out.items()}
    spans = [(t[0], t[-1]) for t in out.values()]
    for a0, a1 in spans:  # every stream was still sending while every other one was
        for b0, b1 in spans:
            assert a0 < b1 and b0 < a1
    rows = metric(gw.base, "specgate_step_batch_rows_total") - rows0
    batches = metric(gw.base, "specgate_step_batches_total") - batches0
    assert rows / batches > 1.5  # turns decoded together, not one after another
    assert metric(gw.base, "specgate_slots_busy") == 0
    assert metric(gw.base, "specgate_slots_resident") == 3


def test_a_client_that_leaves_frees_its_slot(gw):
    with httpx.stream("POST", gw.base + "/v1/chat/completions", headers={"X-SpecGate-Session": "leaver"}, timeout=60,
                      json={"messages": COUNT, "max_tokens": 400, "stream": True}) as resp:
        for line in resp.iter_lines():
            if '"content"' in line and '"role"' not in line:
                break
    deadline = time.monotonic() + 30
    while metric(gw.base, "specgate_slots_busy") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(gw.base, "specgate_slots_busy") == 0
    view = httpx.get(gw.base + "/v1/sessions/leaver").json()
    assert view["completion_tokens"] < 400 and view["state"] == "idle"


def test_a_session_deleted_while_resident_comes_back_empty(gw):
    first = [{"role": "user", "content": "Remember the word pelican. Say ok."}]
    later = [{"role": "user", "content": "Name a colour."}]
    r = httpx.post(gw.base + "/v1/chat/completions", headers={"X-SpecGate-Session": "phoenix"}, timeout=60,
                   json={"messages": first, "max_tokens": 8})
    assert r.status_code == 200
    assert httpx.get(gw.base + "/v1/sessions/phoenix").json()["kv"] == "resident"
    assert httpx.delete(gw.base + "/v1/sessions/phoenix").json()["deleted"] is True
    again = httpx.post(gw.base + "/v1/chat/completions", headers={"X-SpecGate-Session": "phoenix"}, timeout=60,
                       json={"messages": later, "max_tokens": 8}).json()
    fresh = httpx.post(gw.base + "/v1/chat/completions", timeout=60, json={"messages": later, "max_tokens": 8}).json()
    assert again["choices"][0]["message"]["content"] == fresh["choices"][0]["message"]["content"]
    assert again["timings"]["cache_n"] == 0  # nothing of the old session's KV was reused
    view = httpx.get(gw.base + "/v1/sessions/phoenix").json()
    assert view["turns"] == 1 and view["prompt_tokens"] == again["timings"]["context_n"]


def test_a_fifth_session_parks_the_least_recently_used_one(gw):
    for i in range(5):
        r = httpx.post(gw.base + "/v1/chat/completions", headers={"X-SpecGate-Session": f"lru-{i}"}, timeout=60,
                       json={"messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 2})
        assert r.status_code == 200
    where = [httpx.get(f"{gw.base}/v1/sessions/lru-{i}").json()["kv"] for i in range(5)]
    assert where[0] == "ram" and where[1:] == ["resident"] * 4
    again = httpx.post(gw.base + "/v1/chat/completions", headers={"X-SpecGate-Session": "lru-0"}, timeout=60,
                       json={"messages": [{"role": "user", "content": "Say 0."}], "max_tokens": 2}).json()
    assert again["timings"]["cache_n"] > 0 and not again["timings"]["kv_rebuilt"]  # restored from RAM


def test_a_session_deleted_while_parked_frees_its_kv_and_comes_back_empty(gw):
    for i in range(5):  # park-0 ends up parked in RAM behind the other four
        say = [{"role": "user", "content": f"Remember the number {i}. Say ok."}]
        assert httpx.post(gw.base + "/v1/chat/completions", headers={"X-SpecGate-Session": f"park-{i}"}, timeout=60,
                          json={"messages": say, "max_tokens": 2}).status_code == 200
    assert httpx.get(gw.base + "/v1/sessions/park-0").json()["kv"] == "ram"
    parked = metric(gw.base, "specgate_kv_bytes_ram")
    assert parked > 0
    assert httpx.delete(gw.base + "/v1/sessions/park-0").json()["deleted"] is True
    deadline = time.monotonic() + 30  # the delete's drop runs on the model thread
    while metric(gw.base, "specgate_kv_bytes_ram") == parked and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(gw.base, "specgate_kv_bytes_ram") < parked
    again = httpx.post(gw.base + "/v1/chat/completions", headers={"X-SpecGate-Session": "park-0"}, timeout=60,
                       json={"messages": [{"role": "user", "content": "Remember the number 0. Say ok."}],
                             "max_tokens": 2}).json()
    assert again["timings"]["cache_n"] == 0 and not again["timings"]["kv_rebuilt"]


SYSTEM = ("You are the dispatcher of a harbour. Rules: answer in one short sentence; name ships exactly; "
          "never invent cargo. " * 6)


def harbour_turn(base: str, sid: str | None, question: str, key: str | None = None) -> dict:
    headers = {"X-SpecGate-Session": sid} if sid else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    resp = httpx.post(base + "/v1/chat/completions", headers=headers, timeout=120, json={
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 16})
    assert resp.status_code == 200, resp.text
    return resp.json()


# copy tasks: SmolLM2's greedy reply to an open question has near-ties that flip between batch
# splits (a prefix restored, then the rest, against one batch; ../shared/DESIGN.md), a copy has none,
# and a reply carrying another session's sentence would show a leak at once
QUESTIONS = ("Repeat exactly: The Aurora carries salt.", "Repeat exactly: The tug Bravo is late.",
             "Repeat exactly: Captain Lee pilots the ferry.")


@pytest.fixture(scope="module")
def harbour(small_model):
    """A gateway without the prefix cache, and each question's reply from a fresh context:
    asked before any session exists and without a session (implicit sessions off: nothing is
    kept), so there is nothing to adopt."""
    server = start_gateway(small_model, small_model, engine={"slots": 3}, prefix_min_tokens=0,
                           implicit_sessions=False)
    fresh = {q: harbour_turn(server.base, None, q)["choices"][0]["message"]["content"] for q in QUESTIONS}
    yield server, fresh
    server.stop()


def test_sessions_that_share_only_a_prefix_get_exactly_their_own_continuations(harbour):
    """Without the prefix cache, a new session starts from a resident session's KV for the
    system prompt they share, and answers exactly as a fresh request with its own messages does."""
    server, fresh = harbour
    a = harbour_turn(server.base, "pa", QUESTIONS[0])
    b = harbour_turn(server.base, "pb", QUESTIONS[1])
    assert a["timings"]["prefix_shared_n"] == 0
    shared = b["timings"]["prefix_shared_n"]
    assert shared > 50 and b["timings"]["cache_n"] == shared  # the system prompt was not prefilled again
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
    for reply, question in ((a, QUESTIONS[0]), (b, QUESTIONS[1])):
        assert reply["choices"][0]["message"]["content"] == fresh[question]
        assert question.split(": ")[1].rstrip(".") in fresh[question]  # its own sentence, nobody else's
    metrics = httpx.get(server.base + "/metrics").text
    assert "specgate_prefix_adopted_total 1.0" in metrics and "specgate_prefix_misses_total 0.0" in metrics


def test_sessions_that_start_together_prefill_their_shared_system_prompt_at_most_twice(small_model, harbour):
    """Three sessions of one key start at once: the first to show the system prompt is served
    as before, the second prefills it into the prefix cache, the third restores it (waiting
    while it is built); every reply equals a fresh context's, and so does a stateless
    request's, which starts from the longest prefix it shares with a resident session (its
    own whole prompt, here) rather than the shorter cached one.  A second key with the same
    system prompt never gets the first key's KV.  (Implicit sessions off: the stateless
    requests keep nothing, so the cache alone is what they reuse.)"""
    fresh = harbour[1]
    server = start_gateway(small_model, small_model, engine={"slots": 4}, prefix_min_tokens=64,
                           api_keys=("key-a", "key-b"), implicit_sessions=False)
    try:
        replies: dict[str, dict] = {}
        threads = [threading.Thread(target=lambda q=q: replies.__setitem__(q, harbour_turn(
            server.base, f"s-{QUESTIONS.index(q)}", q, "key-a"))) for q in QUESTIONS]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        built = [r["timings"]["prefix_built_n"] for r in replies.values()]
        shared = [r["timings"]["prefix_shared_n"] for r in replies.values()]
        n = max(built)
        assert n > 64 and sorted(built) == [0, 0, n] and sorted(shared) == [0, 0, n]
        for question, reply in replies.items():
            t = reply["timings"]
            assert t["cache_n"] == t["prefix_shared_n"]  # a built prefix is not counted as cached
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == t["prefix_shared_n"]
            assert reply["choices"][0]["message"]["content"] == fresh[question]
        stateless = harbour_turn(server.base, None, QUESTIONS[2], "key-a")
        assert stateless["timings"]["prefix_shared_n"] > n  # s-2's system prompt and question, copied
        assert stateless["timings"]["cache_n"] == stateless["timings"]["prefix_shared_n"]
        assert stateless["choices"][0]["message"]["content"] == fresh[QUESTIONS[2]]
        for _ in range(2):  # same id and prompt under the other key: seen once, then built, never shared
            other = harbour_turn(server.base, None, QUESTIONS[0], "key-b")
            assert other["timings"]["prefix_shared_n"] == 0 and other["timings"]["cache_n"] == 0
            assert other["choices"][0]["message"]["content"] == fresh[QUESTIONS[0]]
        assert other["timings"]["prefix_built_n"] == n
        metrics = httpx.get(server.base + "/metrics", headers={"Authorization": "Bearer key-a"}).text
        assert "specgate_prefix_hits_total 1.0" in metrics and "specgate_prefix_misses_total 2.0" in metrics
    finally:
        server.stop()


TOOL_PROMPT = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": f"Tool {i} reads the plant's logs for one unit and reports flow, pressure, "
                                         "temperature and alarms, with timestamps.",
    "parameters": {"type": "object", "properties": {"unit": {"type": "string", "description": "the unit id"},
                                                    "hours": {"type": "integer"}}, "required": ["unit"]}}}
    for i in range(24)]


def test_a_sibling_conversation_copies_its_tool_prompt_instead_of_prefilling_it(tiny_target, tiny_speculator):
    """Two conversations of one key with the same ~2K-token system prompt and tools: the
    second copies the prompt's KV from the first (idle in its slot) and prefills only its own
    tokens; it does not build the prefix cache entry by prefilling it all again."""
    server = start_gateway(tiny_target, tiny_speculator, engine={"slots": 2})
    try:
        def converse(sid: str, question: str) -> dict:
            r = httpx.post(server.base + "/v1/chat/completions", headers={"X-SpecGate-Session": sid}, timeout=120,
                           json={"messages": [{"role": "system", "content": "You operate the plant."},
                                              {"role": "user", "content": question}],
                                 "tools": TOOL_PROMPT, "max_tokens": 4})
            assert r.status_code == 200, r.text
            return r.json()["timings"]

        first = converse("sib-1", "Which unit alarmed last night?")
        second = converse("sib-2", "Report the flow of unit 7.")
        assert first["context_n"] > 1500 and first["prefix_shared_n"] == 0
        own = second["context_n"] - second["prefix_shared_n"]
        assert second["prefix_built_n"] == 0 and second["prefix_shared_n"] > 1500, second
        assert second["prompt_n"] <= own < 40  # only its own tokens went into the target
    finally:
        server.stop()
