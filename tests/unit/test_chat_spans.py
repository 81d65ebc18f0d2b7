"""Message spans from one marked render (core.chat), without a model."""

from __future__ import annotations

from jinja2 import Template

from core.chat import CHATML, content_offsets, mark, message_bounds

TEMPLATE = Template(CHATML)


def render(messages) -> str:
    return TEMPLATE.render(messages=messages, add_generation_prompt=True)


def test_marked_render_gives_content_offsets_in_the_real_text():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"},
            {"role": "assistant", "content": ""}, {"role": "tool", "content": "42"}]
    text = render(msgs)
    offsets = content_offsets(render(mark(msgs)), text)
    raw = text.encode()
    assert raw[offsets[("s", 1)]:offsets[("e", 1)]] == "héllo".encode()
    assert raw[offsets[("s", 3)]:offsets[("e", 3)]] == b"42"
    assert ("s", 2) not in offsets  # empty content carries no sentinel


def test_bounds_give_the_text_between_contents_to_the_message_before():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": ""}, {"role": "tool", "content": "T"}]
    text = render(msgs)
    raw = text.encode()
    bounds = message_bounds(content_offsets(render(mark(msgs)), text), len(msgs), len(raw), preamble=False)
    parts = [raw[a:b].decode() for _, a, b in bounds]
    assert parts == ["<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n", "U",
                     "<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n", "T"]
    assert raw[bounds[-1][2]:].decode() == "<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_content_gives_no_offsets():
    trimming = Template("{% for m in messages %}[{{ m['content'][:3] }}]{% endfor %}")
    msgs = [{"role": "user", "content": "abcdef"}]
    assert content_offsets(trimming.render(messages=mark(msgs)), trimming.render(messages=msgs)) is None


def test_a_client_sentinel_lookalike_fails_the_check_instead_of_moving_spans():
    msgs = [{"role": "user", "content": "x\ue000s0\ue001y"}]
    assert content_offsets(render(mark(msgs)), render(msgs)) is None


def test_a_preamble_before_the_first_content_is_its_own_span():
    offsets = {("s", 0): 10, ("e", 0): 20}
    assert message_bounds(offsets, 1, 30, preamble=True) == [("preamble", 0, 10), (0, 10, 20)]
    assert message_bounds(offsets, 1, 30, preamble=False) == [(0, 0, 20)]
