"""Pure parts of the benchmarks: summaries and percentiles."""

from __future__ import annotations

from bench.first_turn import summarize
from bench.serving import percentile, summarize_arms


def test_first_turn_summary_speedups():
    rows = [{"target_tokens": 1024, "context_n": 1000, "arm": arm, "ttft_ms": ms, "kept_pct": 20.0,
             "planner_default": "active", "correct": True}
            for arm, ms in (("dense", 10_000.0), ("original", 5_000.0), ("compact", 4_000.0))]
    (s,) = summarize(rows)
    assert s["original_speedup"] == 2.0 and s["compact_speedup"] == 2.5 and s["all_correct"]


def test_arms_summary_marks_dead_servers_and_speedups():
    row = {"ttft_s": 2.0, "correct": True}
    results = {"llama_cpp_server": {"rows": [row, row], "error": None},
               "specgate_sessions": {"rows": [{"ttft_s": 1.0, "correct": True}] * 2, "error": None},
               "llama_cpp_server_cache": {"rows": [row], "error": "RemoteProtocolError: peer closed"}}
    s = summarize_arms(results, 2)
    assert s["specgate_sessions"]["speedup_vs_llama_cpp_server"] == 2.0
    assert not s["llama_cpp_server_cache"]["completed"] and "speedup_vs_llama_cpp_server" not in \
        s["llama_cpp_server_cache"]


def test_percentile_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) in (50.0, 51.0) and percentile(values, 0.99) == 99.0
    assert percentile([3.0], 0.99) == 3.0
