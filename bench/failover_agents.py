"""``specgate bench failover --agent-bodies``: the failover bench at agent size.  A 2-replica
cluster (ops/cluster.sh: redis-server, HAProxy) on tiny models; conversations as coding
agents send them -- ~80 KB streamed bodies (the model's own reasoning sent back, which the
prompt leaves out) whose every turn brings a ~2.6K-token tool result, half over the Anthropic
Messages API with a named session, half over the Responses API resending the history with no
SpecGate session (matched by tokens; Codex's ``session-id`` header, which HAProxy hashes) --
and one replica SIGKILLed while it runs turns, as soon as one starts (so in its prefill: an
agent's turn is mostly prefill).

Per turn: was it served, on the first attempt or on a client's one retry, and did the
stream end with its protocol's terminal event (Anthropic ``message_stop``, Responses
``response.completed``) or break.  HAProxy replays only what got no answer: a stream's
headers wait for its first token (``--stream-hold-s``, 290 s in ops/cluster.sh), so a
replica that dies in a prefill has answered nothing; a stream already under way when its
replica dies is cut, and the bench counts that as a client-visible error."""

from __future__ import annotations

import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.cluster import Cluster
from bench.common import progress, write_result
from bench.failover import kill_while_running
from bench.soak import WORDS

REASONING = "Let me think about the pump logs step by step. " * 1800  # ~82 KB, as agents send it back
TOOL_RESULT_WORDS = 2000  # ~2.6K tokens a turn, as a tool's output
TERMINAL = {"anthropic": "message_stop", "responses": "response.completed"}


def anthropic_body(history: list[dict[str, Any]]) -> dict[str, Any]:
    first = [{"role": "assistant", "content": [{"type": "thinking", "thinking": REASONING, "signature": "s"},
                                               {"type": "text", "text": "Noted."}]}]
    return {"model": "claude-bench", "max_tokens": 24, "stream": True, "system": "You log pumps.",
            "messages": [{"role": "user", "content": "Pump logs follow."}, *first, *history]}


def responses_body(history: list[dict[str, Any]]) -> dict[str, Any]:
    reasoning = {"type": "reasoning", "id": "rs_bench", "summary": [{"type": "summary_text", "text": REASONING}]}
    return {"model": "bench", "instructions": "You log pumps.", "max_output_tokens": 24, "stream": True,
            "store": False, "input": [reasoning, *history]}


def streamed_turn(http: httpx.Client, proto: str, sid: str,
                  history: list[dict[str, Any]]) -> tuple[str, str, str]:
    """(reply text, outcome, replica): outcome ``ok``, or what broke (HTTP status, a cut stream)."""
    # the Responses arm sends Codex's own header (its session id, which names no SpecGate
    # session): HAProxy spreads those conversations by it, as it does Codex's
    path, body, headers = ("/v1/messages", anthropic_body(history), {"X-SpecGate-Session": sid}) \
        if proto == "anthropic" else ("/v1/responses", responses_body(history), {"session-id": sid})
    text, terminal, replica = [], False, ""
    try:
        with http.stream("POST", path, json=body, headers=headers) as r:
            replica = r.headers.get("X-SpecGate-Replica", "")
            if r.status_code != 200:
                return "", f"HTTP {r.status_code}", replica
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = orjson.loads(line[6:])
                kind = event.get("type")
                if kind == "content_block_delta" and event["delta"].get("type") == "text_delta":
                    text.append(event["delta"]["text"])
                elif kind == "response.output_text.delta":
                    text.append(event["delta"])
                elif kind in ("error", "response.failed"):
                    return "", f"error event {kind}", replica
                terminal = terminal or kind == TERMINAL[proto]
    except httpx.HTTPError as exc:
        return "", type(exc).__name__, replica
    return "".join(text), "ok" if terminal else "stream cut", replica


def run(tiny_target: str, tiny_speculator: str, out: Path, n_convs: int = 8, turns: int = 4) -> dict[str, Any]:
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="specgate-failover-agents-")), 2, {
        "SPECGATE_TARGET": tiny_target, "SPECGATE_SPECULATOR": tiny_speculator, "SPECGATE_N_CTX": "16384",
        "SPECGATE_N_THREADS": "1", "SPECGATE_LOG_LEVEL": "warning"})
    convs: dict[str, tuple[str, list[dict[str, Any]]]] = {
        f"a-{i:02d}": ("anthropic" if i % 2 == 0 else "responses", []) for i in range(n_convs)}
    rows: list[dict[str, Any]] = []
    box: list[int] = []
    try:
        with httpx.Client(base_url=cluster.base, timeout=300) as http, ThreadPoolExecutor(4) as pool:
            for t in range(turns):
                killer = threading.Thread(target=kill_while_running, args=(cluster, 2, box)) \
                    if t == turns // 2 else None
                if killer is not None:
                    killer.start()
                progress(f"failover agents: turn {t + 1} of {turns}")

                def go(item: tuple[int, tuple[str, tuple[str, list[dict[str, Any]]]]], t: int = t) -> None:
                    i, (sid, (proto, history)) = item
                    history.append({"role": "user", "content": f"Turn {t}: " + " ".join(
                        WORDS[(i + t + k) % len(WORDS)] for k in range(TOOL_RESULT_WORDS))})
                    outcomes, served_by = [], []
                    for _ in range(2):  # a client retries once
                        reply, outcome, replica = streamed_turn(http, proto, sid, history)
                        outcomes.append(outcome)
                        served_by.append(replica)
                        if outcome == "ok":
                            history.append({"role": "assistant", "content": reply})
                            break
                    else:
                        history.pop()
                    rows.append({"conversation": sid, "protocol": proto, "turn": t + 1, "attempts": outcomes,
                                 "served_by": served_by})

                list(pool.map(go, enumerate(convs.items())))
                if killer is not None:
                    killer.join()
        named = [sid for sid, (proto, _) in convs.items() if proto == "anthropic"]
        intact = sum(_user_turns(cluster.record("anonymous", sid)) == _user_turns({"history": convs[sid][1]})
                     for sid in named)
    finally:
        cluster.down()
    body_kb = {p: round(len(orjson.dumps(f([{"role": "user", "content": "x"}]))) / 1024, 1)
               for p, f in (("anthropic", anthropic_body), ("responses", responses_body))}
    summary = {"conversations": n_convs, "turns_per_conversation": turns, "body_kib": body_kb,
               "turns_served": sum(r["attempts"][-1] == "ok" for r in rows), "turns_expected": n_convs * turns,
               "client_visible_errors": sum(a != "ok" for r in rows for a in r["attempts"]),
               "turns_failed_after_retry": sum(r["attempts"][-1] != "ok" for r in rows),
               "named_histories_intact": f"{intact} of {len(named)}",
               "turns_running_on_r2_at_kill": box[0] if box else 0,
               "conversations_moved_to_r1_at_the_kill": _moved(rows, turns // 2)}
    write_result(out, "failover_agents", {"summary": summary, "rows": rows},
                 {"target": tiny_target, "speculator": tiny_speculator})
    return summary


def _user_turns(record: dict[str, Any] | None) -> list[str]:
    return [m["content"] for m in (record or {}).get("history", []) if m.get("role") == "user"
            and str(m.get("content", "")).startswith("Turn ")]


def _moved(rows: list[dict[str, Any]], kill_turn: int) -> int:
    """Conversations r2 served on the turn before the kill and r1 on the killed turn."""
    by = {(r["conversation"], r["turn"]): r["served_by"][-1] for r in rows}
    return sum(by.get((sid, kill_turn)) == "r2" and by.get((sid, kill_turn + 1)) == "r1"
               for sid in {sid for sid, _ in by})
