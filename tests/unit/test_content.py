"""Telling source code, logs and prose apart (core.specprefill.content)."""

from __future__ import annotations

from bench.textgen import WORDS_PER_TOKEN, agent_turn, code_turn
from core.specprefill.content import ContentKind, content_kind


def test_the_benchmarks_prompts_are_told_apart():
    code = code_turn(1500, 0.35, "svc-1", "T-1")["messages"][3]["content"]
    prose = agent_turn(int(1500 * WORDS_PER_TOKEN), 0.35, 300, "svc-0", "T-5")["messages"][3]["content"]
    assert content_kind(code) is ContentKind.CODE
    assert content_kind(prose) is ContentKind.PROSE


def test_log_lines_with_timestamps_or_levels_are_logs():
    stamped = "\n".join(f"2026-12-0{i % 9 + 1} 12:00:{i % 60:02d} worker {i} finished its batch" for i in range(50))
    leveled = "\n".join(f"[WARN] disk {i} is at {i % 100}% of its quota" for i in range(50))
    assert content_kind(stamped) is ContentKind.LOGS
    assert content_kind(leveled) is ContentKind.LOGS


def test_other_languages_are_code_and_a_few_code_lines_do_not_make_prose_code():
    rust = "\n".join(["fn main() {", "    let x = vec![1, 2, 3];", "    for v in x {", "        println!(\"{}\", v);",
                      "    }", "}"] * 10)
    assert content_kind(rust) is ContentKind.CODE
    essay = "\n".join(["The committee met on Tuesday and discussed the harbor budget at length"] * 30
                      + ["def f(x):", "    return x"])
    assert content_kind(essay) is ContentKind.PROSE
    assert content_kind("") is ContentKind.PROSE
