"""SpecPrefill keeping whole lines and code blocks on a real engine (``whole_lines``,
``code_blocks``; core/specprefill/lines.py): what the target prefills of a file read is whole
lines, and a def line it keeps brings its body."""

from __future__ import annotations

import random

import numpy as np

from core.chat import ChatTemplate
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
