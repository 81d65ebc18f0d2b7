"""Deterministic text for prompts, benchmarks and evals: varied filler sentences
and a needle prompt (a chat JSON with one planted fact, asked for at the end).

    python -m bench.textgen --words 2650 --depth 0.3 > /tmp/needle.json
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import orjson

WORDS_PER_TOKEN = 1 / 1.14  # filler words per Qwen token, measured on this filler

SUBJECTS = ["The archive", "A committee", "The harbor office", "Our field team", "The old library",
            "A regional council", "The weather station", "The night shift", "A survey crew", "The museum"]
VERBS = ["reviewed", "catalogued", "inspected", "summarized", "measured", "repainted", "audited",
         "relocated", "photographed", "debated"]
OBJECTS = ["the northern warehouse ledgers", "several boxes of maritime charts", "the bridge expansion joints",
           "a collection of pressed flowers", "the annual rainfall tables", "two hundred survey markers",
           "the municipal tram timetable", "a set of brass navigation tools", "the seed bank inventory",
           "the coastal erosion photographs"]
TAILS = ["before the spring festival.", "after a long delay.", "with little public notice.",
         "under a tight budget.", "for the third year running.", "despite the heavy rain.",
         "while volunteers watched.", "as part of a routine check.", "at the request of the mayor.",
         "during the quiet season."]


def filler(n_words: int, rng: random.Random) -> list[str]:
    sentences, words = [], 0
    while words < n_words:
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}"
        sentences.append(s)
        words += len(s.split())
    return sentences


def build(n_words: int, depth: float, seed: int, key: str, value: str) -> dict:
    rng = random.Random(seed)
    sentences = filler(n_words, rng)
    fact = f"Important: the secret access code for the {key} is {value}."
    sentences.insert(int(len(sentences) * depth), fact)
    doc = " ".join(sentences)
    question = f"What is the secret access code for the {key}? Answer with the code only."
    return {"messages": [
        {"role": "system", "content": "You are a careful assistant. Answer from the document."},
        {"role": "user", "content": f"Document:\n{doc}\n\n{question}"},
    ], "expected": value}


AGENT_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_log", "description": "Read a service's log file",
        "parameters": {"type": "object", "properties": {"service": {"type": "string"}}, "required": ["service"]}}},
    {"type": "function", "function": {
        "name": "restart_service", "description": "Restart a service by name",
        "parameters": {"type": "object", "properties": {"service": {"type": "string"}}, "required": ["service"]}}},
]


def agent_turn(n_words: int, depth: float, seed: int, key: str, value: str) -> dict:
    """An agent-shaped prompt, as the openai client sends it: tools, a task, the assistant's
    tool call, and the long tool result (a log with one planted fact) to answer from."""
    rng = random.Random(seed)
    sentences = filler(n_words, rng)
    sentences.insert(int(len(sentences) * depth), f"NOTICE: the deploy token for {key} is {value}.")
    return tool_turn("You are an operations agent. Use the tools; answer briefly.",
                     f"What is the deploy token for {key}? Check its log and reply with the token only.",
                     f"call_{seed}", "read_log", {"service": key}, "\n".join(sentences), AGENT_TOOLS, value)


def tool_turn(system: str, question: str, call_id: str, tool: str, arguments: dict[str, Any], result: str,
              tools: list[dict[str, Any]], expected: str) -> dict:
    """The messages an agent framework sends after one tool call: system, the user's
    question, the assistant's call and the tool's result."""
    call = {"id": call_id, "type": "function",
            "function": {"name": tool, "arguments": orjson.dumps(arguments).decode()}}
    return {"messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ], "tools": tools, "expected": expected}


CODE_SOURCES = ("tarfile", "argparse", "configparser", "zipfile", "shutil", "tempfile", "logging/__init__",
                "json/decoder", "csv", "difflib")  # standard-library modules, read from this Python
CODE_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a source file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]
CHARS_PER_CODE_TOKEN = 3.3  # Qwen tokens of Python source, measured on these modules


def source_code(n_chars: int) -> str:
    """The first ``n_chars`` of this Python's standard-library sources (whole lines)."""
    import sysconfig
    from pathlib import Path

    root, size = Path(sysconfig.get_paths()["stdlib"]), 0
    out: list[str] = []
    for name in CODE_SOURCES:
        for line in (root / f"{name}.py").read_text().splitlines():
            if size >= n_chars:
                return "\n".join(out)
            out.append(line)
            size += len(line) + 1
    return "\n".join(out)


def code_turn(n_tokens: int, depth: float, key: str, value: str) -> dict:
    """A coding agent's turn: tools, a task, a ``read_file`` call and about ``n_tokens``
    of Python source as its result, with one planted constant to answer from."""
    lines = source_code(int(n_tokens * CHARS_PER_CODE_TOKEN)).splitlines()
    lines.insert(int(len(lines) * depth), f'DEPLOY_TOKEN_{key.upper().replace("-", "_")} = "{value}"')
    return tool_turn("You are a coding agent. Use the tools; answer briefly.",
                     f"What is the deploy token constant for {key} in src/{key}.py? Reply with its value only.",
                     f"call_{key}", "read_file", {"path": f"src/{key}.py"}, "\n".join(lines), CODE_TOOLS, value)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--words", type=int, default=2200)
    ap.add_argument("--depth", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--key", default="blue vault")
    ap.add_argument("--value", default="KX-4471")
    a = ap.parse_args()
    print(orjson.dumps(build(a.words, a.depth, a.seed, a.key, a.value)).decode())


if __name__ == "__main__":
    main()
