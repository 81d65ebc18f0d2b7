"""A prefix computed once serves a restart: the KV tier keeps the system prompt's KV in a
folder, and a new server on that folder restores it instead of prefilling it.  A tier file
that fails its checks is deleted and the prefix recomputed.  Real models (the tiny pair),
real gateways, one after another on one folder, or two at once (replicas on a shared mount)."""

from __future__ import annotations

import httpx

from tests.support import start_gateway, until

SYSTEM = ("You operate the plant. Units report flow, pressure and temperature every minute; alarms name "
          "the unit, the reading and the limit it crossed. ") * 40  # ~1.2K tokens, the shared prefix


def converse(base: str, sid: str, question: str) -> dict:
    r = httpx.post(base + "/v1/chat/completions", headers={"X-SpecGate-Session": sid}, timeout=120,
                   json={"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                         "max_tokens": 4, "specprefill": False})
    assert r.status_code == 200, r.text
    return r.json()["timings"]


def metric(base: str, name: str) -> float:
    line = next(x for x in httpx.get(base + "/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def serve(tiny_target, tiny_speculator, tier):
    return start_gateway(tiny_target, tiny_speculator, engine={"slots": 1}, kv_tier_dir=str(tier))


def test_a_restarted_server_restores_the_prefix_from_the_tier(tiny_target, tiny_speculator, tmp_path):
    first = serve(tiny_target, tiny_speculator, tmp_path)
    try:
        converse(first.base, "t-1", "Which unit alarmed?")
        built = converse(first.base, "t-2", "Report unit 7.")  # seen twice: built, and written to the tier
        n = built["prefix_built_n"]
        assert n > 1000
    finally:
        first.stop()  # closing waits for the tier's writes
    assert len(list(tmp_path.rglob("*.kv"))) == 1
    again = serve(tiny_target, tiny_speculator, tmp_path)
    try:
        t = converse(again.base, "t-3", "Report unit 9.")  # the first time this process sees it
        assert t["prefix_shared_n"] == n and t["prefix_built_n"] == 0 and t["cache_n"] == n
        assert t["prefix_source"] == "tier" and t["prefix_bytes"] > 0 and 0 < t["prefix_ms"] <= t["ttft_ms"]
        assert t["prompt_n"] == t["context_n"] - n  # only its own tokens were prefilled
        assert metric(again.base, "specgate_kv_tier_hits_total") == 1
    finally:
        again.stop()


def test_a_second_replica_on_the_same_folder_restores_a_prefix_the_first_computed(
        tiny_target, tiny_speculator, tmp_path):
    """Two servers running at once on one folder (a shared mount): the second has never seen
    the prompt, and restores the prefix the first wrote instead of prefilling it."""
    first, second = serve(tiny_target, tiny_speculator, tmp_path), serve(tiny_target, tiny_speculator, tmp_path)
    try:
        converse(first.base, "r-1", "Which unit alarmed?")
        n = converse(first.base, "r-2", "Report unit 7.")["prefix_built_n"]
        assert until(lambda: len(list(tmp_path.rglob("*.kv"))) == 1)  # written off the reply path
        t = converse(second.base, "r-3", "Report unit 9.")
        assert t["prefix_shared_n"] == n and t["prefix_built_n"] == 0 and t["prompt_n"] == t["context_n"] - n
        assert metric(second.base, "specgate_kv_tier_hits_total") == 1
    finally:
        first.stop()
        second.stop()


def test_a_damaged_tier_file_is_recomputed_not_loaded(tiny_target, tiny_speculator, tmp_path):
    first = serve(tiny_target, tiny_speculator, tmp_path)
    try:
        converse(first.base, "d-1", "Which unit alarmed?")
        n = converse(first.base, "d-2", "Report unit 7.")["prefix_built_n"]
    finally:
        first.stop()
    (path,) = tmp_path.rglob("*.kv")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    again = serve(tiny_target, tiny_speculator, tmp_path)
    try:
        t = converse(again.base, "d-3", "Report unit 9.")
        assert t["prefix_shared_n"] == 0 and t["prefix_built_n"] == n  # recomputed, then written again
        assert t["prefix_source"] == "built" and t["prefix_bytes"] == 0
        assert metric(again.base, "specgate_kv_tier_rejected_total") == 1
    finally:
        again.stop()


TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": f"Tool {i} reads one unit's logs: flow, pressure, temperature, alarms.",
    "parameters": {"type": "object", "properties": {"unit": {"type": "string"}}, "required": ["unit"]}}}
    for i in range(24)]


def agent_turn(base: str, sid: str, question: str, **extra: object) -> dict:
    r = httpx.post(base + "/v1/chat/completions", headers={"X-SpecGate-Session": sid}, timeout=120,
                   json={"messages": [{"role": "system", "content": "You operate the plant."},
                                      {"role": "user", "content": question}], "tools": TOOLS, "max_tokens": 4,
                         **extra})
    assert r.status_code == 200, r.text
    return r.json()["timings"]


def test_a_sibling_conversation_fills_the_tier_by_copying_and_a_restart_restores_it(
        tiny_target, tiny_speculator, tmp_path):
    """The agent's path: a tool-heavy prompt (its speculator deferred by the tool guard), a
    sibling conversation that copies it from the first (no prefill), the entry filled from
    that copy and written to the tier, and a restarted server that restores it."""
    first = start_gateway(tiny_target, tiny_speculator, engine={"slots": 2}, kv_tier_dir=str(tmp_path))
    try:
        agent_turn(first.base, "s-1", "Which unit alarmed?")
        sibling = agent_turn(first.base, "s-2", "Report unit 7.")
        n = sibling["prefix_shared_n"]
        assert n > 1000 and sibling["prefix_built_n"] == 0 and sibling["prefix_source"] == "resident"
        # the entry is copied in idle time, after the reply
        assert until(lambda: metric(first.base, "specgate_prefix_copied_total") == 1)
    finally:
        first.stop()
    again = start_gateway(tiny_target, tiny_speculator, engine={"slots": 2}, kv_tier_dir=str(tmp_path))
    try:
        t = agent_turn(again.base, "s-3", "Report unit 9.")
        assert t["prefix_shared_n"] > 1000 and t["prefix_built_n"] == 0 and t["prompt_n"] < 40, t
    finally:
        again.stop()


def test_a_restarted_server_restores_a_session_from_its_checkpoint(tiny_target, tiny_speculator, tmp_path,
                                                                   redis_server):
    """Idle time checkpoints a session's KV into the tier; after a restart the session (its
    history in Redis) is rebuilt from that checkpoint, prefilling only what came after it."""
    def gateway():
        return start_gateway(tiny_target, tiny_speculator, engine={"slots": 1}, kv_tier_dir=str(tmp_path),
                             redis_url=redis_server.url, prefix_min_tokens=0, kv_checkpoint_tokens=256)
    history = [{"role": "system", "content": SYSTEM}]
    first = gateway()
    try:
        for question in ("Which unit alarmed?", "Report unit 7."):
            history.append({"role": "user", "content": question})
            r = httpx.post(first.base + "/v1/chat/completions", headers={"X-SpecGate-Session": "cp-1"}, timeout=120,
                           json={"messages": history, "max_tokens": 4, "specprefill": False})
            assert r.status_code == 200, r.text
            history.append(r.json()["choices"][0]["message"])
        assert until(lambda: metric(first.base, "specgate_session_checkpoints_total") >= 1)
    finally:
        first.stop()
    again = gateway()
    try:
        history.append({"role": "user", "content": "And unit 9?"})
        r = httpx.post(again.base + "/v1/chat/completions", headers={"X-SpecGate-Session": "cp-1"}, timeout=120,
                       json={"messages": history, "max_tokens": 4, "specprefill": False})
        assert r.status_code == 200, r.text
        t = r.json()["timings"]
        # the checkpoint is turn 1's (turn 2 added fewer than 256 tokens): restored up to where the
        # re-rendered reply parts from the generated one, and only the rest prefilled
        assert t["kv_rebuilt"] and t["prefix_shared_n"] > 1100 and t["prompt_n"] < 60, t
        assert t["prompt_n"] == t["context_n"] - t["prefix_shared_n"]
        assert metric(again.base, "specgate_session_checkpoint_restores_total") == 1
    finally:
        again.stop()


def test_the_tier_stays_within_its_byte_budget_under_a_soak(tiny_target, tiny_speculator, tmp_path, redis_server):
    """Sixteen conversations, each with a system prompt of its own, one slot: each is displaced
    by the next and checkpointed in idle time.  The checkpoints together take several times the
    tier's 8 MiB budget; the folder never holds more than the budget, and the oldest go."""
    budget = 8 << 20
    gw = start_gateway(tiny_target, tiny_speculator, engine={"slots": 1}, kv_tier_dir=str(tmp_path),
                       kv_tier_max_mb=budget >> 20, redis_url=redis_server.url, prefix_min_tokens=0,
                       kv_checkpoint_tokens=256)
    used, sizes = [], []
    try:
        for i in range(16):
            r = httpx.post(gw.base + "/v1/chat/completions", headers={"X-SpecGate-Session": f"soak-{i}"},
                           timeout=120, json={"messages": [
                               {"role": "system", "content": f"Plant {i}. " + SYSTEM},
                               {"role": "user", "content": "Which unit alarmed?"}], "max_tokens": 4,
                               "specprefill": False})
            assert r.status_code == 200, r.text
            assert until(lambda i=i: metric(gw.base, "specgate_session_checkpoints_total") >= i + 1)
            files = list(tmp_path.glob("*/prefixes/*.kv"))
            used.append(sum(p.stat().st_size for p in files))
            sizes.append(max(p.stat().st_size for p in files))
    finally:
        gw.stop()
    assert 16 * min(sizes) > 3 * budget  # what was written: several budgets' worth
    assert max(used) <= budget, used
    assert len(list(tmp_path.glob("*/prefixes/*.kv"))) < 16  # the oldest went


def test_idle_catch_up_completes_a_copied_prefix_with_the_scorers_part(tiny_target, tiny_speculator, tmp_path):
    """The tool guard defers the scorer, so the prefix entry copied from the first conversation
    holds the target's part only.  Idle catch-up brings the scorers up; the entry then gains
    the scorer's part, here and in the tier, and a conversation on a restarted server starts
    with its scorer holding the prefix: it lags by the conversation's own tokens only."""
    first = start_gateway(tiny_target, tiny_speculator, engine={"slots": 2}, kv_tier_dir=str(tmp_path),
                          catch_up_tokens=256)
    try:
        # no scoring (as break-even decides for an agent's first turns on the real pair): the
        # scorer is deferred, and the entry copied from s-1 holds the target's part only
        agent_turn(first.base, "s-1", "Which unit alarmed?", specprefill=False)
        sibling = agent_turn(first.base, "s-2", "Report unit 7.", specprefill=False)
        n = sibling["prefix_shared_n"]
        assert n > 1000 and until(lambda: metric(first.base, "specgate_prefix_copied_total") == 1)
        assert sibling["speculator_cache_n"] < n  # idle catch-up may have begun on s-1: a part at most
        assert until(lambda: metric(first.base, "specgate_prefix_completed_total") == 1)
    finally:
        first.stop()  # closing waits for the tier's writes: the completed entry replaced the first
    again = start_gateway(tiny_target, tiny_speculator, engine={"slots": 2}, kv_tier_dir=str(tmp_path))
    try:
        t = agent_turn(again.base, "s-3", "Report unit 9.")
        assert t["prefix_shared_n"] == n and t["prefix_source"] == "tier", t
        assert t["speculator_deferred_n"] <= t["context_n"] - n + 4, t  # the prefix was not deferred
    finally:
        again.stop()


def test_a_replica_with_other_kv_settings_neither_reads_nor_deletes_the_entries(tiny_target, tiny_speculator,
                                                                               tmp_path):
    """llama.cpp refuses a saved state whose stream count differs (another --slots, another
    --kv-layout): such a replica on the same folder must keep to entries of its own layout,
    not load the first one's, fail, and delete them (issue 51, point 7)."""
    first = serve(tiny_target, tiny_speculator, tmp_path)
    try:
        converse(first.base, "f-1", "Which unit alarmed?")
        n = converse(first.base, "f-2", "Report unit 7.")["prefix_built_n"]
    finally:
        first.stop()
    (entry,) = tmp_path.rglob("*.kv")
    other = start_gateway(tiny_target, tiny_speculator, engine={"slots": 2}, kv_tier_dir=str(tmp_path))
    try:
        t = converse(other.base, "f-3", "Report unit 9.")
        assert t.get("prefix_source") != "tier" and metric(other.base, "specgate_kv_tier_rejected_total") == 0
    finally:
        other.stop()
    assert entry.exists()
    again = serve(tiny_target, tiny_speculator, tmp_path)  # the first layout again: its entry still serves
    try:
        assert converse(again.base, "f-4", "Report unit 3.")["prefix_shared_n"] == n
    finally:
        again.stop()


def test_a_stop_right_after_a_siblings_reply_keeps_the_shared_prefix(tiny_target, tiny_speculator, tmp_path):
    """A sibling conversation adopts the agent's prefix from the first one's slot and leaves
    the prefix's cache entry for idle work to copy.  The server is stopped before idle work
    gets to it (here: idle work held off): the drain copies and writes it, so after a restart a
    new conversation restores the prefix instead of prefilling it (issue 51, point 9)."""
    from gateway import keys

    first = start_gateway(tiny_target, tiny_speculator, engine={"slots": 2}, kv_tier_dir=str(tmp_path))
    try:
        first.app[keys.MANAGER].worker.idle_enabled = False  # the stop comes before any idle work
        converse(first.base, "p-1", "Which unit alarmed?")
        sibling = converse(first.base, "p-2", "Report unit 7.")
        n = sibling["prefix_shared_n"]
        assert n > 1000 and sibling["prefix_source"] == "resident" and not list(tmp_path.rglob("*.kv"))
    finally:
        first.stop()
    assert len(list(tmp_path.rglob("*.kv"))) == 1
    again = start_gateway(tiny_target, tiny_speculator, engine={"slots": 2}, kv_tier_dir=str(tmp_path))
    try:
        t = converse(again.base, "p-3", "Report unit 9.")
        assert t["prefix_source"] == "tier" and t["prefix_shared_n"] == n and t["prompt_n"] == t["context_n"] - n
    finally:
        again.stop()


def test_a_drain_step_that_never_returns_is_given_up_and_the_stop_goes_on(tiny_target, tiny_speculator, tmp_path):
    """The drain's tier settling waits on the model thread; held here, as a hung thread would
    hold it, that step is given up after its bound (the drain timeout, at least 5 s, plus
    10 s), logged, and the drain goes on to hand the sessions over: a SIGTERM always ends."""
    import time

    from structlog.testing import capture_logs

    from gateway import keys
    from gateway.app import drain
    from tests.support import ModelThreadHeld

    gw = start_gateway(tiny_target, tiny_speculator, engine={"slots": 1}, kv_tier_dir=str(tmp_path),
                       drain_timeout_s=0.0)
    try:
        converse(gw.base, "d-1", "Which unit alarmed?")
        with capture_logs() as logs, ModelThreadHeld(gw):
            t0 = time.monotonic()
            gw.call(drain(gw.app))
            took = time.monotonic() - t0
        events = {e["event"]: e for e in logs}
        assert events["drain_step_timeout"]["step"] == "settle_kv" and 14 < took < 30
        assert "drain_done" in events and gw.app[keys.RUNNER].draining
        assert httpx.get(gw.base + "/ready").status_code == 503
    finally:
        gw.stop()
