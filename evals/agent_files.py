"""Tool results as coding agents get them, with questions whose answers must be copied from
them (``specgate eval depth``): a Python module read with ``Read`` (``cat -n`` form), ``grep
-n`` output, a pytest failure report, a JSON config.  Everything is generated from a seed --
names, numbers, messages -- so no model has seen it and a fresh seed gives fresh tasks (pure).

Question kinds, each answered by copying:

- ``function_source``: the exact source of a function from the file just read;
- ``definition_line``: the line a name is defined on (the number ``cat -n`` or ``grep -n``
  shows);
- ``constant_value``: a module constant's value;
- ``failing_test``: the name of the test that failed;
- ``error_message``: the failure's message;
- ``json_value``: a value from a JSON config.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

KINDS = ("function_source", "definition_line", "constant_value", "failing_test", "error_message", "json_value")
NOUNS = ("flux ledger valve quota cache shard beacon relay ticket vector plume gauge tariff batch cursor kernel "
         "harbor socket parcel signal anchor bucket cipher drift ember filter glyph hinge lattice mirror").split()
VERBS = "compute resolve merge rotate drain settle probe stamp index scan fold trim weigh route pack".split()
ADJS = "stale fresh pending sealed local remote cold warm spare idle".split()


@dataclass(slots=True, frozen=True)
class Question:
    kind: str
    ask: str  # the user's request (it comes before the tool call, as an agent's user writes it)
    answer: str  # what the reply must hold, exactly (definition_line: the number)


@dataclass(slots=True, frozen=True)
class ToolResult:
    tool: str  # the tool called: Read, Grep or Bash
    arguments: dict[str, str]
    content: str  # what the tool returned
    questions: tuple[Question, ...]  # the first asked with the call, the others as follow-ups


def _name(rng: random.Random, parts: int = 3) -> str:
    return "_".join([rng.choice(VERBS), *rng.sample(NOUNS, parts - 1)])


def _constant(rng: random.Random) -> tuple[str, str]:
    name = "_".join(rng.sample(NOUNS, 2)).upper() + "_" + rng.choice(("LIMIT", "TIMEOUT_MS", "RETRIES", "SCALE"))
    value = str(rng.randint(11, 9899)) if rng.random() < 0.7 else f'"{rng.choice(ADJS)}-{rng.choice(NOUNS)}"'
    return name, value


def _function(rng: random.Random, name: str, constants: list[str], indent: str = "") -> list[str]:
    args = rng.sample(NOUNS, rng.randint(1, 3))
    body = [f'{indent}def {name}({", ".join(args)}):',
            f'{indent}    """{rng.choice(VERBS).capitalize()} the {rng.choice(ADJS)} {rng.choice(NOUNS)} '
            f'for each {rng.choice(NOUNS)}."""']
    acc = f"{rng.choice(NOUNS)}_total"
    body.append(f"{indent}    {acc} = {rng.randint(0, 9)}")
    for _ in range(rng.randint(2, 5)):
        a = rng.choice(args)
        step = rng.choice((f"{acc} += {a} * {rng.randint(2, 97)}",
                           f"{acc} -= len(str({a})) % {rng.randint(3, 17)}",
                           f"{acc} = max({acc}, {rng.choice(constants)} - {rng.randint(1, 50)})"))
        if rng.random() < 0.4:
            body += [f"{indent}    if {a} is None:", f'{indent}        raise ValueError("{a} is {rng.choice(ADJS)}")']
        if rng.random() < 0.35:
            body += [f"{indent}    for {rng.choice(NOUNS)}_item in range({rng.randint(2, 12)}):",
                     f"{indent}        {step}"]
        else:
            body.append(f"{indent}    {step}")
    body.append(f"{indent}    return {acc}")
    return body


def python_module(rng: random.Random, path: str, target_chars: int = 9000) -> ToolResult:
    """A module of constants, functions and a class, about ``target_chars`` long (~2.9K
    tokens of the Qwen tokenizer at 9000), read whole with ``Read``."""
    lines = [f'"""The {rng.choice(ADJS)} {rng.choice(NOUNS)} {rng.choice(NOUNS)} helpers."""', "",
             "from __future__ import annotations", "", "import math", ""]
    constants: list[tuple[str, str, int]] = []
    for _ in range(rng.randint(4, 7)):
        name, value = _constant(rng)
        lines.append(f"{name} = {value}")
        constants.append((name, value, len(lines)))
    lines.append("")
    functions: list[tuple[str, int, int]] = []  # name, first line, last line (1-based)
    names = [c[0] for c in constants]
    while sum(len(x) + 1 for x in lines) < target_chars:
        lines.append("")
        if rng.random() < 0.2:
            lines += [f"class {rng.choice(NOUNS).capitalize()}{rng.choice(NOUNS).capitalize()}:", ""]
            for _ in range(rng.randint(1, 3)):
                fn = _function(rng, _name(rng), names, indent="    ")
                lines += [*fn, ""]
            continue
        name = _name(rng)
        fn = _function(rng, name, names)
        functions.append((name, len(lines) + 1, len(lines) + len(fn)))
        lines += fn
        lines.append("")
    numbered = "\n".join(f"{i:>6}\t{line}" for i, line in enumerate(lines, 1))
    sources = rng.sample(functions[1:-1] if len(functions) > 3 else functions, min(2, len(functions)))
    picked_constants = rng.sample(constants, 3)  # 4-7 in every module
    defined = rng.sample(functions, min(2, len(functions)))

    def source_of(fn: tuple[str, int, int], first: bool) -> Question:
        name, start, end = fn
        ask = f"Read {path}. Then reply" if first else "Now reply"
        return Question("function_source", f"{ask} with only the complete source code of the function `{name}` "
                        f"in {path}, copied verbatim from the file (without the line numbers), in a ```python code "
                        "block.", "\n".join(lines[start - 1:end]))

    questions = (
        source_of(sources[0], True),
        *(Question("constant_value", f"In {path}, what is the value of `{name}`? Answer with the value only.", value)
          for name, value, _ in picked_constants),
        *(Question("definition_line", f"On which line of {path} is the function `{name}` defined? The Read "
                   "output shows each line's number before it. Answer with the line number only.", str(line))
          for name, line, _ in defined),
        *(source_of(fn, False) for fn in sources[1:]),
    )
    return ToolResult("Read", {"file_path": path}, numbered, questions)


def pytest_report(rng: random.Random, target_chars: int = 8000) -> ToolResult:
    """``pytest -v`` output: many passing tests, one failure with its traceback and message."""
    module = f"tests/test_{rng.choice(NOUNS)}_{rng.choice(NOUNS)}.py"
    out = ["============================= test session starts ==============================",
           "platform linux -- Python 3.11.7, pytest-8.3.4, pluggy-1.5.0", "rootdir: /srv/plant",
           f"collected {rng.randint(80, 160)} items", ""]
    failing = f"test_{_name(rng)}_{rng.choice(ADJS)}"
    left, right = rng.randint(2, 40), rng.randint(41, 99)
    message = f"expected {left} {rng.choice(NOUNS)} entries after {rng.choice(VERBS)}, got {right}"
    placed = False
    while sum(len(x) + 1 for x in out) < target_chars * 0.8:
        test = f"test_{_name(rng)}"
        if not placed and rng.random() < 0.08 and len(out) > 30:
            out.append(f"{module}::{failing} FAILED")
            placed = True
        out.append(f"{module}::{test} PASSED")
    if not placed:
        out.append(f"{module}::{failing} FAILED")
    out += ["", "=================================== FAILURES ===================================",
            f"_________________________ {failing} _________________________", "",
            f"    def {failing}():", f"        result = {_name(rng)}({rng.randint(1, 9)})",
            f">       assert result == {left}, \"{message}\"", f"E       AssertionError: {message}",
            f"E       assert {right} == {left}", "", f"{module}:{rng.randint(20, 400)}: AssertionError",
            "=========================== short test summary info ============================",
            f"FAILED {module}::{failing} - AssertionError: {message}",
            f"==================== 1 failed, {rng.randint(80, 160)} passed in "
            f"{rng.randint(2, 40)}.{rng.randint(10, 99)}s ===================="]
    questions = (
        Question("failing_test", "Run the tests and tell me the name of the test function that failed. Answer "
                 "with the name only.", failing),
        Question("error_message", "What is the exact error message of that failure, the text after "
                 "`AssertionError:`? Quote it.", message),
    )
    return ToolResult("Bash", {"command": "python -m pytest -v", "description": "Run the test suite"},
                      "\n".join(out), questions)


def grep_output(rng: random.Random, target_chars: int = 8000) -> ToolResult:
    """``grep -rn 'def '`` over a package: path, line number and line, many files."""
    out: list[str] = []
    wanted: tuple[str, str, int] | None = None
    while sum(len(x) + 1 for x in out) < target_chars:
        path = f"src/{rng.choice(NOUNS)}/{rng.choice(NOUNS)}_{rng.choice(NOUNS)}.py"
        line = 1
        for _ in range(rng.randint(3, 9)):
            line += rng.randint(4, 40)
            name = _name(rng)
            out.append(f"{path}:{line}:def {name}({', '.join(rng.sample(NOUNS, 2))}):")
            if wanted is None and rng.random() < 0.03:
                wanted = (path, name, line)
    if wanted is None:
        path, line_no, text = out[len(out) // 2].split(":", 2)
        wanted = (path, text[4:text.index("(")], int(line_no))
    path, name, line = wanted
    questions = (Question("definition_line", f"Find where `{name}` is defined: quote its line of the grep output "
                          "exactly, with the path and line number.", str(line)),)
    return ToolResult("Grep", {"pattern": "def ", "path": "src", "output_mode": "content", "-n": "true"},
                      "\n".join(out), questions)


def json_config(rng: random.Random, target_chars: int = 7000) -> ToolResult:
    """A service configuration read as JSON: nested sections of settings."""
    import json

    doc: dict[str, dict[str, dict[str, object]]] = {}
    while len(json.dumps(doc, indent=2)) < target_chars:
        section = doc.setdefault(rng.choice(("services", "queues", "limits", "storage", "alerts")), {})
        section[f"{rng.choice(NOUNS)}_{rng.choice(NOUNS)}"] = {
            f"{rng.choice(NOUNS)}_{rng.choice(('ms', 'max', 'count', 'mode'))}":
                rng.randint(1, 99999) if rng.random() < 0.6 else f"{rng.choice(ADJS)}-{rng.choice(NOUNS)}"
            for _ in range(rng.randint(2, 6))}
    section_name = rng.choice(list(doc))
    entry = rng.choice(list(doc[section_name]))
    key = rng.choice(list(doc[section_name][entry]))
    value = doc[section_name][entry][key]
    questions = (Question("json_value", f"Read config/plant.json and tell me the value of "
                          f"`{section_name}.{entry}.{key}`. Answer with the value only.",
                          str(value)),)
    return ToolResult("Read", {"file_path": "config/plant.json"}, json.dumps(doc, indent=2), questions)


def tool_results(seed: int, n: int) -> list[ToolResult]:
    """``n`` tool results, mostly source files (what coding agents read most), a pytest run,
    grep output and a config among them."""
    rng = random.Random(seed)
    out: list[ToolResult] = []
    for i in range(n):
        pick = i % 5
        if pick in (0, 2, 4):
            out.append(python_module(rng, f"src/{rng.choice(NOUNS)}/{rng.choice(NOUNS)}_{rng.choice(NOUNS)}.py"))
        elif pick == 1:
            out.append(pytest_report(rng))
        else:
            out.append(grep_output(rng) if rng.random() < 0.5 else json_config(rng))
    return out


def correct(question: Question, reply: str) -> bool:
    """Whether ``reply`` holds the answer: the source with trailing spaces and code fences
    aside; a line number as the reply's first number; other values verbatim (quotes aside)."""
    if question.kind == "function_source":
        return _lines(question.answer) in _lines(reply)
    if question.kind == "definition_line":  # the quoted line (its number and the definition), or the number alone
        name = re.search(r"`(\w+)`", question.ask)
        line = next((x for x in reply.splitlines() if name and f"def {name.group(1)}(" in x), "")
        if not line and "def " not in reply:
            return re.findall(r"\d+", reply)[:1] == [question.answer]
        return re.search(rf"(^|\D){question.answer}(\D|$)", line) is not None
    return question.answer.strip('"') in reply


def _lines(text: str) -> str:
    text = re.sub(r"^```\w*\s*$", "", text, flags=re.M)
    return "\n".join(line.rstrip() for line in text.strip().splitlines())
