"""Prompt-lookup decoding on real models (core/decoding/lookup.py): a reply that copies its
context is plain greedy decoding's, token for token, in fewer target steps; with a grammar too;
sampled replies run; and with nothing to copy it decodes as plain does.  SmolLM2 as both models:
greedy replies without near-ties."""

from __future__ import annotations

import dataclasses

from core.chat import ChatTemplate
from core.constraints import SYNTAXES, tool_call
from core.kv.positions import SessionKV
from core.policies import SamplingParams
from tests.support import policy, with_sampling

SOURCE = "\n".join(f"def step_{i}(x):\n    return x * {i + 3} + {i * 7}\n" for i in range(12))


def copy_prompt(engine):
    """The reply already begun with the file's first line: what follows is a copy (a reply's
    first words can be near-ties, which batched and single decodes may break either way)."""
    chat = ChatTemplate(engine.target)
    prompt = chat.render([{"role": "system", "content": "You copy code exactly."},
                          {"role": "user", "content": f"Here is a file:\n{SOURCE}\nRepeat the file exactly."}])
    begun = engine.target.tokenize("```python\ndef step_0(x):\n", add_special=False)
    return dataclasses.replace(prompt, tokens=prompt.tokens + tuple(begun))


def run(engine, prompt, **decoding):
    engine.slot_cells.load(None)
    params = with_sampling(policy(enabled=False, **decoding), SamplingParams(max_tokens=120))
    return engine.run(prompt, params, kv=SessionKV())


def test_a_copying_reply_is_plain_greedys_in_fewer_steps(smol_engine):
    prompt = copy_prompt(smol_engine)
    plain = run(smol_engine, prompt)
    looked = run(smol_engine, prompt, lookup=True)
    assert looked.tokens == plain.tokens and looked.text == plain.text
    stats = looked.timings.speculative
    assert looked.timings.decode_mode == "lookup" and stats.n_accepted > len(plain.tokens) // 3
    assert stats.n_rounds < len(plain.tokens)  # several tokens a verify


def test_under_a_grammar_the_reply_is_plain_constrained_decodings(smol_engine):
    tools = [{"type": "function", "function": {"name": "copy", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
    constraint = tool_call(tools, "copy", False, SYNTAXES["qwen"])
    prompt = copy_prompt(smol_engine)
    sampling = SamplingParams(max_tokens=80, constraint=constraint)
    outs = []
    for extra in ({}, {"lookup": True}):
        smol_engine.slot_cells.load(None)
        outs.append(smol_engine.run(prompt, with_sampling(policy(enabled=False, **extra), sampling), kv=SessionKV()))
    assert outs[1].tokens == outs[0].tokens and outs[1].text.startswith("<tool_call>")


def test_sampled_replies_run_and_nothing_to_copy_decodes_as_plain(smol_engine):
    prompt = copy_prompt(smol_engine)
    smol_engine.slot_cells.load(None)
    sampled = smol_engine.run(prompt, with_sampling(policy(enabled=False, lookup=True),
                                                    SamplingParams(max_tokens=60, temperature=0.8, seed=3)),
                              kv=SessionKV())
    assert len(sampled.tokens) > 10 and sampled.timings.decode_mode == "lookup"
    chat = ChatTemplate(smol_engine.target)
    free = chat.render([{"role": "user", "content": "Write one sentence about rivers."}])
    plain, looked = run(smol_engine, free), run(smol_engine, free, lookup=True)
    assert looked.tokens == plain.tokens


def test_drafts_the_grammar_forbids_are_rejected_and_the_call_goes_on(smol_engine):
    """An earlier call in the context drafts another tool's name and keys: those drafts are
    forbidden by the forced call's grammar and must neither be accepted nor end the reply
    (feeding a forbidden token to the matcher broke it: a 7-token Edit in bench decode_copy)."""
    tools = [{"type": "function", "function": {"name": "copy", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
    earlier = '<tool_call>\n{"name": "Edit", "arguments": {"old": "def step_0(x):"}}\n</tool_call>'
    chat = ChatTemplate(smol_engine.target)
    prompt = chat.render([{"role": "system", "content": "You copy code exactly."},
                          {"role": "user", "content": f"Here is a file:\n{SOURCE}\nEdit it."},
                          {"role": "assistant", "content": earlier},
                          {"role": "user", "content": "Now call copy with the file's first function."}])
    sampling = SamplingParams(max_tokens=60, constraint=tool_call(tools, "copy", False, SYNTAXES["qwen"]))
    outs = []
    for extra in ({}, {"lookup": True}):
        smol_engine.slot_cells.load(None)
        outs.append(smol_engine.run(prompt, with_sampling(policy(enabled=False, **extra), sampling), kv=SessionKV()))
    assert outs[0].text.startswith('<tool_call>\n{"name": "copy"') and len(outs[0].tokens) > 12
    assert outs[1].timings.speculative.n_drafted > 0
    assert outs[1].tokens == outs[0].tokens


def test_a_file_read_is_looked_up_without_its_line_numbers_and_as_a_json_string(smol_engine):
    """A reply copies a file as code, not as ``Read`` showed it (``cat -n`` numbers), and an
    ``Edit``'s old_string holds it JSON-escaped: the drafter looks both views up beside the
    prompt, and the reply is still plain greedy decoding's."""
    numbered = "".join(f"{i:>6}\t{line}\n" for i, line in enumerate(SOURCE.splitlines(), 1))
    chat = ChatTemplate(smol_engine.target)
    prompt = chat.render_chat([
        {"role": "system", "content": "You copy code exactly."}, {"role": "user", "content": "Read a.py"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "Read", "arguments": '{"file_path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": numbered}], ())
    views = smol_engine.target.detokenize(smol_engine._copy_views(prompt))
    assert "def step_1(x):\n    return x * 4 + 7\n" in views and "\t" not in views.split("<")[0]
    assert "def step_1(x):\\n    return x * 4 + 7\\n" in views  # as a JSON string's inside
    begun = smol_engine.target.tokenize("```python\ndef step_0(x):\n", add_special=False)
    prompt = dataclasses.replace(prompt, tokens=prompt.tokens + tuple(begun))
    plain, looked = run(smol_engine, prompt), run(smol_engine, prompt, lookup=True)
    assert looked.tokens == plain.tokens and looked.timings.speculative.n_accepted > 0
