"""Pure parts of the benchmarks: summaries and percentiles."""

from __future__ import annotations

from bench import agent_session
from bench.agent_session import check_call, script
from bench.first_turn import summarize
from bench.serving import percentile


def test_first_turn_summary_speedups():
    rows = [{"target_tokens": 1024, "context_n": 1000, "arm": arm, "ttft_ms": ms, "kept_pct": 20.0,
             "planner_default": "active", "correct": True}
            for arm, ms in (("dense", 10_000.0), ("original", 5_000.0), ("compact", 4_000.0))]
    (s,) = summarize(rows)
    assert s["original_speedup"] == 2.0 and s["compact_speedup"] == 2.5 and s["all_correct"]


def test_agent_script_is_agent_shaped():
    turns = script((300, 200))
    first = turns[0]["append"]
    assert [m["role"] for m in first] == ["user", "assistant", "tool"]
    assert first[1]["tool_calls"][0]["id"] == first[2]["tool_call_id"]
    assert turns[0]["expect"] in first[2]["content"]
    assert turns[-1]["kind"] == "call" and turns[-1]["append"][0]["role"] == "user"


def test_tool_call_validity_checks_name_and_schema():
    ok = check_call([{"name": "restart_service", "arguments": '{"service": "billing"}'}], "billing")
    assert ok == {"valid_call": True, "right_call": True}
    wrong = check_call([{"name": "read_log", "arguments": '{"service": "billing"}'}], "billing")
    assert wrong["valid_call"] and not wrong["right_call"]
    assert not check_call([{"name": "restart_service", "arguments": '{"svc": 1}'}], "billing")["valid_call"]
    assert not check_call([{"name": "format_disk", "arguments": "{}"}], "billing")["valid_call"]
    assert not check_call([{"name": "restart_service", "arguments": "{oops"}], "billing")["valid_call"]
    assert check_call([], "billing")["why"] == "no tool call"


def test_agent_summary_marks_dead_servers_and_speedups():
    def row(kind: str, ttft: float, status: str = "active") -> dict:
        extra = {"correct": True} if kind == "long" else {"valid_call": True, "right_call": True}
        return {"kind": kind, "ttft_s": ttft, "timings": {"specprefill": status, "ttft_ms": ttft * 1e3}, **extra}

    results = {"specgate_dense": {"rows": [row("long", 100, "disabled"), row("long", 120, "disabled"),
                                           row("call", 5)], "error": None},
               "specgate_structural": {"rows": [row("long", 50), row("long", 60), row("call", 5)], "error": None},
               "llama_cpp_server": {"rows": [row("long", 90)], "error": "APIError: boom"}}
    s = agent_session.summarize(results, 3)
    assert s["specgate_structural"]["long_speedup_vs_dense"] == 2.0
    assert s["specgate_structural"]["long_active"] == 2 and s["specgate_dense"]["long_active"] == 0
    assert not s["llama_cpp_server"]["completed"] and "long_speedup_vs_dense" not in s["llama_cpp_server"]
    assert s["specgate_structural"]["valid_call"] and not s["llama_cpp_server"]["valid_call"]


def test_percentile_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) in (50.0, 51.0) and percentile(values, 0.99) == 99.0
    assert percentile([3.0], 0.99) == 3.0


def test_scorer_arms_always_include_today_and_speedups_compare_to_it():
    from bench import scorers

    assert scorers.parse_arms("target-early:9/filter-sum,speculator-early:8") == [
        ("speculator-full", "max"), ("target-early:9", "filter-sum"), ("speculator-early:8", "max")]
    assert scorers.parse_arms("speculator-full/max") == [("speculator-full", "max")]
    rows = [{"target_tokens": 4096, "context_n": 4200, "arm": a, "ttft_ms": ms, "correct": ok}
            for a, ms, ok in (("dense", 100.0, True), (scorers.TODAY, 80.0, True),
                              ("target-early:9/filter-sum", 50.0, False))]
    rows.append({"target_tokens": 8192, "context_n": 8300, "arm": "dense", "ttft_ms": 1.0, "correct": True})
    (s,) = scorers.summarize(rows)  # 8K lacks today's arm: no verdict there
    assert s["speedup"] == {scorers.TODAY: 1.25, "target-early:9/filter-sum": 2.0}
    assert s["beats_today"] == {"target-early:9/filter-sum": True}
    assert s["correct"]["target-early:9/filter-sum"] is False


def test_concurrency_counts_rebuilds_full_reprefills_and_prefix_hits():
    from bench.concurrency import kv_reuse

    rows = [{"turn": 1, "context_n": 1200, "cache_n": 0, "kv_rebuilt": False, "prefix_shared_n": 1000},
            {"turn": 1, "context_n": 1200, "cache_n": 0, "kv_rebuilt": False, "prefix_shared_n": 0},
            {"turn": 2, "context_n": 1600, "cache_n": 1230, "kv_rebuilt": False, "prefix_shared_n": 0},
            {"turn": 2, "context_n": 1600, "cache_n": 0, "kv_rebuilt": True, "prefix_shared_n": 0}]
    assert kv_reuse(rows) == {"kv_rebuilds": 1, "full_reprefills": 1, "prefix_hits": 1}
    assert kv_reuse([{"turn": 1, "context_n": None}]) == {"kv_rebuilds": None, "full_reprefills": None,
                                                          "prefix_hits": None}


def test_long_prefill_counts_the_gaps_that_overlap_the_window():
    from bench.long_prefill import gaps_in, long_turn, stats

    rows = [{"arrivals": [0.0, 1.0, 3.0, 3.5]}, {"arrivals": [10.0, 12.0]}]
    assert gaps_in(rows, 0.5, 3.2) == [1.0, 2.0, 0.5]  # every gap with a part inside the window
    assert gaps_in(rows, 4.0, 9.0) == []
    assert stats([0.1, 0.2, 0.9]) == {"p50_s": 0.2, "p95_s": 0.9, "n": 3}
    assert stats([]) == {"p50_s": None, "p95_s": None, "n": 0}
    user, call, tool = long_turn(500)
    assert call["tool_calls"][0]["id"] == tool["tool_call_id"] and call["content"] is None
    assert "E-4242" in tool["content"] and len(tool["content"].split()) > 400


def test_a_rerun_keeps_the_earlier_rows_it_does_not_redo(tmp_path):
    import orjson

    from bench.common import earlier_rows

    path = tmp_path / "concurrency.json"
    assert earlier_rows(path, {"turns": 6}, "levels", lambda r: True) == []
    rows = [{"arm": a, "sessions": n} for a in ("slots", "serial") for n in (1, 8)]
    path.write_bytes(orjson.dumps({"params": {"turns": 6}, "levels": rows}))
    kept = earlier_rows(path, {"turns": 6}, "levels", lambda r: r["arm"] == "slots" and r["sessions"] == 8)
    assert kept == [r for r in rows if (r["arm"], r["sessions"]) != ("slots", 8)]
    assert earlier_rows(path, {"turns": 3}, "levels", lambda r: False) == []  # other sizes: nothing kept


def test_concurrency_counts_answers_with_their_own_and_with_another_sessions_code():
    import re

    from bench.concurrency import quoted_codes, turns

    params = {"turns": 2, "tool_tokens": 60}
    code = {(i, k + 1): re.findall(r"E-\d{4}", t[2]["content"])[0]
            for i in (0, 1) for k, t in enumerate(turns(i, 2, 60))}
    rows = [{"session": "a-2-0", "turn": 1, "answer": f"The code is {code[(0, 1)]}."},
            {"session": "a-2-0", "turn": 2, "answer": f"Earlier {code[(0, 1)]}, not this turn's."},
            {"session": "a-2-1", "turn": 1, "answer": f"{code[(1, 1)]} and {code[(0, 2)]}"},
            {"session": "a-2-1", "turn": 2, "answer": None}]
    assert quoted_codes(rows, params) == {"answers_own_code": 2, "answers_foreign_code": 1}


def test_stateless_summary_compares_each_turn_with_named_and_takes_a_running_round():
    from bench.stateless import summarize

    def row(turn: int, ttft: float, server_ms: float | None = None) -> dict:
        return {"turn": turn, "prompt_tokens": 100 * turn, "reused_tokens": 90 * (turn - 1), "ttft_s": ttft,
                "server_ttft_ms": server_ms}

    named = {"agents": [[row(1, 10.0, 9000), row(2, 4.0, 3000)], [row(1, 30.0, 29000), row(2, 6.0, 5000)],
                        [row(1, 20.0, 19000)]]}  # the third round stopped after turn 1
    stateless = {"agents": [[row(1, 11.0, 10000), row(2, 6.0, 5000)], [row(1, 28.0, 27000), row(2, 9.0, None)],
                            [row(1, 21.0, 20000)]]}
    s = summarize({"specgate_named": named, "specgate_stateless": stateless})
    assert [t["turn"] for t in s["specgate_named"]] == [1, 2]
    assert s["specgate_named"][0]["ttft_s"] == 20.0 and s["specgate_named"][1]["ttft_s"] == 5.0
    t1, t2 = s["specgate_stateless"]
    assert t1["ttft_s"] == 20.0 and t1["ttft_median_s"] == 21.0 and t1["ttft_vs_named"] == 1.0
    assert t1["server_ttft_s"] == 19.0 and t1["server_ttft_vs_named"] == 1.0
    assert t2["ttft_vs_named"] == 1.5 and t2["reused_tokens"] == 90
    assert t2["server_ttft_s"] is None and "server_ttft_vs_named" not in t2  # one row had none: no mean


def test_depth_logs_hold_one_alarm_and_the_checks_read_replies():
    from bench.depth import check, plant_log, with_tool_result

    for day in (1, 2, 3):
        log, unit = plant_log(day)
        alarms = [line for line in log.splitlines() if "ALARM" in line]
        assert len(alarms) == 1 and f" {unit} " in alarms[0]
    tools = [{"name": "Bash"}]
    _, unit = plant_log(2)
    said = check({"content": [{"type": "text", "text": f"The alarm came from {unit}."}]}, tools, unit)
    assert said["kind"] == "text" and said["names_alarmed_unit"] is True
    wrong = check({"content": [{"type": "text", "text": "No alarm."}]}, tools, unit)
    assert wrong["names_alarmed_unit"] is False
    call = check({"content": [{"type": "tool_use", "name": "Bash", "input": {"command": "ls"}}]}, tools, unit)
    assert call == {**call, "kind": "tool_call", "valid_tool_call": True, "names_alarmed_unit": None}
    unknown = check({"content": [{"type": "tool_use", "name": "Nope", "input": {}}]}, tools, unit)
    assert unknown["valid_tool_call"] is False
    doc = with_tool_result({"messages": [{"role": "user", "content": "go"}]}, 1)
    call_block, result = doc["messages"][1]["content"][1], doc["messages"][2]["content"][0]
    assert call_block["id"] == result["tool_use_id"] and result["content"] == plant_log(1)[0]


def test_coding_agents_reads_the_requests_a_replica_served(tmp_path):
    import orjson

    from bench.coding_agents import served

    log = tmp_path / "replica.log"
    events = [{"event": "request_start", "request_id": "a", "path": "/v1/messages", "tools": True},
              {"event": "turn_done", "request_id": "a", "context_n": 100, "cache_n": 90, "prompt_n": 10,
               "ttft_ms": 5.0, "finish": "stop"},
              {"event": "request_error", "path": "/v1/messages", "status": 409, "code": "session_busy",
               "error": "busy"}]
    log.write_bytes(b"not json\n" + b"\n".join(orjson.dumps(e) for e in events) + b"\n")
    rows, mark = served(log, 0)
    assert mark == 4 and rows[0]["route"] == "/v1/messages" and rows[0]["cache_n"] == 90
    assert rows[1] == {"refused": {"path": "/v1/messages", "status": 409, "code": "session_busy", "error": "busy"}}
    assert served(log, mark) == ([], 4)


def test_llama_server_prompt_eval_is_read_from_its_last_timing_line(tmp_path):
    from bench.agent_scale import prompt_eval_ms

    log = tmp_path / "llama_server.log"
    log.write_text("0.05.1 I slot print_timing: id  0 | task 0 | prompt eval time =  161368.03 ms / 11839 tokens "
                   "(   13.63 ms per token,    73.37 tokens per second)\n"
                   "1.00.2 I slot print_timing: id  0 | task 9 | prompt eval time =   57012.50 ms /  2191 tokens "
                   "(   26.02 ms per token,    38.43 tokens per second)\n"
                   "1.00.2 I slot print_timing: id  0 | task 9 |        eval time =     801.00 ms /     8 tokens\n")
    assert prompt_eval_ms(log) == 57012.50
    log.write_text("no timings yet\n")
    assert prompt_eval_ms(log) == 0.0
