"""SpecPrefill keeping whole lines and code blocks on a real engine (``whole_lines``,
``code_blocks``; core/specprefill/lines.py): what the target prefills of a file read is whole
lines, and a def line it keeps brings its body."""

from __future__ import annotations

import random

import numpy as np

from core.chat import ChatTemplate
from core.kv.positions import SessionKV
from core.llama import seq_cells
from core.policies import SamplingParams
from evals.agent_files import python_module
from tests.support import forced, with_sampling


def test_kept_tokens_form_whole_lines_and_kept_defs_their_blocks(tiny_engine):
    module = python_module(random.Random(3), "src/a.py", target_chars=3000)
    chat = ChatTemplate(tiny_engine.target)
    prompt = chat.render([{"role": "system", "content": "You read files."},
                          {"role": "user", "content": "Read src/a.py.\n" + module.content}])
    pieces = [tiny_engine.target.token_bytes(t) for t in prompt.tokens]
    line_of = np.cumsum([p.count(b"\n") for p in pieces]) - np.array([p.count(b"\n") for p in pieces])
    alone = {"code_skeleton": False, "named_lines": False}  # the skeleton's def lines open no block
    for flags in ({"whole_lines": True, **alone}, {"whole_lines": True, "code_blocks": True, **alone}):
        tiny_engine.slot_cells.load(None)
        res = tiny_engine.run(prompt, with_sampling(forced(mass=0.3, **flags), SamplingParams(max_tokens=1)))
        kept = np.zeros(len(prompt), dtype=bool)
        kept[res.kept] = True
        user = prompt.spans[-1]
        assert 0 < kept[user.start:user.end].mean() < 1
        for line in np.unique(line_of[user.start + 8:user.end - 8]):
            on_line = kept[user.start + 8:user.end - 8][line_of[user.start + 8:user.end - 8] == line]
            assert on_line.all() or not on_line.any(), f"line {line} kept in part"
        if flags.get("code_blocks"):
            text = b"".join(p for p, k in zip(pieces, kept, strict=True) if k).decode(errors="replace")
            for header in [x for x in text.splitlines() if "\tdef " in x and not x.startswith("       ")]:
                n = int(header.split("\t")[0])
                body = [x for x in module.content.splitlines()[n:n + 3] if x.split("\t")[1].startswith("    ")]
                assert all(b in text for b in body), f"def on line {n} kept without its body"


def test_a_function_the_request_names_is_kept_whole_from_the_file_read(tiny_engine):
    module = python_module(random.Random(5), "src/b.py", target_chars=3000)
    question = module.questions[0]  # function_source: the answer is the function's source
    assert question.kind == "function_source"
    messages = [{"role": "system", "content": "You read files."}, {"role": "user", "content": question.ask},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "Read", "arguments": '{"file_path": "src/b.py"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": module.content}]
    chat = ChatTemplate(tiny_engine.target)
    prompt = chat.render_chat(messages, ())
    pieces = [tiny_engine.target.token_bytes(t) for t in prompt.tokens]
    texts = {}
    for named in (False, True):
        tiny_engine.slot_cells.load(None)
        res = tiny_engine.run(prompt, with_sampling(forced(mass=0.1, named_lines=named), SamplingParams(max_tokens=1)))
        kept = np.zeros(len(prompt), dtype=bool)
        kept[res.kept] = True
        assert kept.mean() < 0.9
        texts[named] = b"".join(p for p, k in zip(pieces, kept, strict=True) if k).decode(errors="replace")
    source = [x.split("\t", 1)[1] for x in module.content.splitlines()
              if x.split("\t", 1)[1].strip() and x.split("\t", 1)[1] in question.answer.splitlines()]
    assert len(source) >= 3
    assert all(line in texts[True] for line in source), "the named function's lines were dropped"
    assert not all(line in texts[False] for line in source), "kept without naming: the test shows nothing"


def test_a_follow_up_naming_a_dropped_function_recalls_its_lines(tiny_engine):
    """A later request naming a function an earlier sparse prefill dropped brings its lines
    back into the target, each at its own position (core.kv.recall), and leaves every cell
    outside the recalled run as it was: the same positions, the same K and V."""
    module = python_module(random.Random(5), "src/b.py", target_chars=3000)
    first, later = module.questions[0], module.questions[-1]
    assert first.kind == later.kind == "function_source"
    call = {"id": "c1", "type": "function", "function": {"name": "Read", "arguments": '{"file_path": "src/b.py"}'}}
    history = [{"role": "system", "content": "You read files."}, {"role": "user", "content": first.ask},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": module.content}]
    chat = ChatTemplate(tiny_engine.target)
    params = with_sampling(forced(mass=0.1), SamplingParams(max_tokens=1))
    kv = SessionKV()
    tiny_engine.slot_cells.load(None)
    r1 = tiny_engine.run(chat.render_chat(history, ()), params, kv=kv)
    assert r1.timings.recalled_n == 0 and r1.timings.specprefill == "active"
    body = [x.split("\t", 1)[1] for x in module.content.splitlines()[1:]
            if x.split("\t", 1)[1] in later.answer.splitlines()[1:] and x.split("\t", 1)[1].strip()]
    assert not all(line in _held_text(tiny_engine, kv) for line in body), "kept already: the test shows nothing"
    before = _cells(tiny_engine)

    follow = history + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": later.ask}]
    r2 = tiny_engine.run(chat.render_chat(follow, ()), params, kv=kv)
    assert r2.timings.recalled_n > 0
    assert all(line in _held_text(tiny_engine, kv) for line in body), "the named function is still missing"
    after = _cells(tiny_engine)
    held = [p for p in kv.target.kv_pos if p >= 0]
    assert list(after.positions) == sorted(held), "cells and bookkeeping disagree, or out of order"
    new = after.positions[~np.isin(after.positions, before.positions)]
    # a named block comes back as one run: cells kept inside it are prefilled again, the rest stay
    outside = (after.positions < new.min()) | (after.positions > new.max())
    same = np.isin(after.positions, before.positions) & outside
    assert same.sum() > len(before.positions) // 2
    old = np.argsort(before.positions)
    for k_after, k_before in zip(after.k, before.k, strict=True):
        assert np.array_equal(k_after[same], k_before[old][np.isin(before.positions[old], after.positions[same])])

    r3 = tiny_engine.run(chat.render_chat(follow + [{"role": "assistant", "content": "Done."},
                                                    {"role": "user", "content": later.ask}], ()), params, kv=kv)
    assert r3.timings.recalled_n == 0  # nothing named is dropped any more


def _held_text(engine, kv: SessionKV) -> str:
    return b"".join(engine.target.token_bytes(t) for t, p in zip(kv.target.tokens, kv.target.kv_pos, strict=True)
                    if p >= 0).decode(errors="replace")


def _cells(engine) -> seq_cells.Cells:
    seq = engine.target_ctx.seq(0)
    return seq_cells.parse(seq.save(), seq.id)
