"""Long-context tasks generated locally and deterministically from a seed.

Families: single-key needle, multi-key needle (distractor keys), variable
tracking (a chain of assignments spread through the text), multi-document QA
over generated facts, and tool-use continuation (a long tool output, then a
question that needs one detail of it).  Each task is an agent-shaped chat, as
the openai client sends it: the question, the assistant's tool call that
fetched the long text, and the text as a ``role: tool`` message, with the
tools offered; an answer is correct when it contains the expected string.

Each task also carries an *answer prefix* (RULER's device, e.g. "The access code
for the cedar depot is"), which the eval appends after the generation prompt: the
1.5B otherwise narrates its search for dozens of tokens before it names the
answer, and a short answer budget then scores dense itself as wrong.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.textgen import filler

FAMILIES = ("needle", "multikey", "vartrack", "multidoc", "tooluse")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
KEYS = ["copper gate", "violet tower", "north cellar", "river lock", "glass hangar", "iron pantry",
        "salt archive", "maple vault", "stone kiosk", "cedar depot"]
CITIES = ["Lisbon", "Tallinn", "Oaxaca", "Nagoya", "Tromso", "Porto", "Quito", "Hobart", "Bergen", "Cusco"]
PRODUCTS = ["solar valves", "ceramic gears", "wool filters", "glass lenses", "carbon springs", "brass hinges"]
SYSTEM = "You are a careful assistant. Answer from the tool results only, briefly."
TOOLS: tuple[dict[str, Any], ...] = (
    {"type": "function", "function": {
        "name": "fetch_document", "description": "Fetch a document by name",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}},
    {"type": "function", "function": {
        "name": "list_orders", "description": "List today's warehouse orders",
        "parameters": {"type": "object", "properties": {}}}},
)


Made = tuple[tuple[dict[str, Any], ...], str, str]  # messages, expected answer, answer prefix


@dataclass(slots=True, frozen=True)
class Task:
    id: str
    family: str
    depth: float
    messages: tuple[dict[str, Any], ...]
    expected: str
    answer_prefix: str


def _code(rng: random.Random) -> str:
    return f"{rng.choice('BCDFGHJKLMNPRSTVWXZ')}{rng.choice('AEIOU')}-{rng.randint(1000, 9999)}"


def _insert(sentences: list[str], fact: str, depth: float) -> list[str]:
    out = list(sentences)
    out.insert(int(len(out) * depth), fact)
    return out


def _chat(body: str, question: str, tool: str = "fetch_document",
          args: str = '{"name": "report"}') -> tuple[dict[str, Any], ...]:
    call = {"id": "call_0", "type": "function", "function": {"name": tool, "arguments": args}}
    return ({"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": body})


def needle(rng: random.Random, words: int, depth: float) -> Made:
    key, value = rng.choice(KEYS), _code(rng)
    doc = _insert(filler(words, rng), f"The access code for the {key} is {value}.", depth)
    return _chat(" ".join(doc), f"What is the access code for the {key}? Answer with the code."), value, \
        f"The access code for the {key} is"


def multikey(rng: random.Random, words: int, depth: float) -> Made:
    keys = rng.sample(KEYS, 4)
    values = [_code(rng) for _ in keys]
    doc = filler(words, rng)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        d = depth if i == 0 else rng.random()
        doc = _insert(doc, f"The access code for the {k} is {v}.", d)
    return _chat(" ".join(doc), f"What is the access code for the {keys[0]}? Answer with the code."), values[0], \
        f"The access code for the {keys[0]} is"


def vartrack(rng: random.Random, words: int, depth: float) -> Made:
    names = rng.sample(["QX", "ZB", "MR", "TK", "VL", "HP", "NW", "JD"], 4)
    value = str(rng.randint(10000, 99999))
    doc = filler(words, rng)
    spots = sorted([depth] + [rng.uniform(0.05, 0.95) for _ in range(3)])
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = {names[i - 1]}." for i in range(1, 4)]
    for spot, stmt in zip(reversed(spots), reversed(statements), strict=True):
        doc = _insert(doc, stmt, spot)
    question = f"Following the VAR assignments, what number does {names[3]} hold? Answer with the number."
    return _chat(" ".join(doc), question), value, f"Following the assignments, {names[3]} holds the number"


def multidoc(rng: random.Random, words: int, depth: float) -> Made:
    n_docs = 6
    firms = [f"{rng.choice(['Arlo', 'Brisk', 'Corvid', 'Delta', 'Ember', 'Fjord', 'Gale', 'Helix'])} "
             f"{rng.choice(['Works', 'Labs', 'Mills', 'Foundry', 'Supply'])} {i + 1}" for i in range(n_docs)]
    target = min(n_docs - 1, int(depth * n_docs))
    parts, answer = [], ""
    for i, firm in enumerate(firms):
        city, product, year = rng.choice(CITIES), rng.choice(PRODUCTS), rng.randint(1950, 2019)
        if i == target:
            answer = city
        body = " ".join(filler(words // n_docs, rng))
        parts.append(f"Document {i + 1}: {firm} was founded in {year} in {city} and makes {product}. {body}")
    question = f"In which city was {firms[target]} founded? Answer with the city."
    return _chat("\n\n".join(parts), question), answer, f"{firms[target]} was founded in the city of"


def tooluse(rng: random.Random, words: int, depth: float) -> Made:
    n_rows = max(8, words // 14)
    target = min(n_rows - 1, int(depth * n_rows))
    rows, answer = [], ""
    for i in range(n_rows):
        order = f"ORD-{rng.randint(100000, 999999)}"
        city = rng.choice(CITIES)
        qty = rng.randint(1, 400)
        if i == target:
            answer, target_order = city, order
        rows.append(f'{{"order": "{order}", "ship_to": "{city}", "qty": {qty}, "status": "'
                    f'{rng.choice(["packed", "shipped", "held", "returned"])}"}}')
    question = f"To which city does today's order {target_order} ship? Answer with the city."
    return _chat("\n".join(rows), question, "list_orders", "{}"), answer, f"Order {target_order} ships to"


MAKERS: dict[str, Callable[[random.Random, int, float], Made]] = {
    "needle": needle, "multikey": multikey, "vartrack": vartrack, "multidoc": multidoc, "tooluse": tooluse}


def generate(per_family: int, seed: int, words: int) -> list[Task]:
    tasks = []
    for family in FAMILIES:
        for i in range(per_family):
            rng = random.Random(f"{seed}-{family}-{i}")
            depth = DEPTHS[i % len(DEPTHS)]
            messages, expected, prefix = MAKERS[family](rng, words, depth)
            tasks.append(Task(f"{family}-{i}", family, depth, messages, expected, prefix))
    return tasks
