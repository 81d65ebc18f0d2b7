"""The structural guard on prompts rendered by the real chat template (Qwen's)."""

from __future__ import annotations

from bench.textgen import agent_turn
from core.policies import PrefillPolicy
from core.specprefill.guard import STRUCT_TAIL


def dense_tokens(engine, prompt, policy: PrefillPolicy) -> set[int]:
    return {i for a, b in engine.plan(prompt, policy).protected for i in range(a, b)}


def text_of(engine, prompt, idx: set[int]) -> str:
    return engine.target.detokenize([prompt.tokens[i] for i in sorted(idx)], special=True)


def test_agent_prompt_keeps_tools_call_and_headers_and_frees_the_result(tiny_engine):
    doc = agent_turn(900, depth=0.5, seed=1, key="billing", value="T-9")
    prompt = tiny_engine.chat.render_chat(doc["messages"], doc["tools"])
    policy = PrefillPolicy(min_tokens=0, break_even=False)
    plan = tiny_engine.plan(prompt, policy)
    assert plan.status == "active"
    assert "system prompt and tool definitions" in plan.reason and "1 assistant tool call(s)" in plan.reason
    kept = dense_tokens(tiny_engine, prompt, policy)
    dense_text = text_of(tiny_engine, prompt, kept)
    for must in ('"name": "read_log"', '"name": "restart_service"', "<tool_call>", "What is the deploy token",
                 "<tool_response>", "<|im_start|>assistant"):
        assert must in dense_text, must
    result = next(s for s in prompt.spans if s.role == "tool")
    assert len(kept & set(range(result.start, result.end))) <= 32 + STRUCT_TAIL  # only its header and closing tokens
    assert len(kept) < 0.4 * len(prompt)
    skipped = tiny_engine.plan(prompt, PrefillPolicy(min_tokens=0, break_even=False, guard_mode="skip"))
    assert skipped.status == "skipped_tool_guard" and "request defines tools" in skipped.reason


def test_code_in_a_user_document_does_not_trip_the_keyword_scan(tiny_engine):
    code = "\n".join(f"def get_item_{i}(self):\n    return self.set_value({i})" for i in range(120))
    messages = [{"role": "system", "content": "You review code."},
                {"role": "user", "content": code + "\n\nWhich method returns 42?"}]
    prompt = tiny_engine.chat.render(messages)
    plan = tiny_engine.plan(prompt, PrefillPolicy(min_tokens=0, break_even=False, guard_mode="skip"))
    assert plan.status == "active"  # the old head scan read get_/set_ in the document and skipped
    tool_system = [{"role": "system", "content": "Call get_weather(city) when asked about weather."},
                   {"role": "user", "content": "Weather in Oslo? " * 50}]
    tooly = tiny_engine.plan(tiny_engine.chat.render(tool_system),
                             PrefillPolicy(min_tokens=0, break_even=False, guard_mode="skip"))
    assert tooly.status == "skipped_tool_guard" and "system prompt mentions" in tooly.reason


def test_a_raw_prompt_keeps_a_tool_like_head(tiny_engine):
    from core.prompt import Prompt

    raw = Prompt(tuple(tiny_engine.target.tokenize('{"function": "get_weather"} ' + "filler text " * 200)))
    policy = PrefillPolicy(min_tokens=0, break_even=False, guard_scan_tokens=64)
    plan = tiny_engine.plan(raw, policy)
    assert plan.status == "active" and plan.protected == ((0, 64),) and "the first 64 tokens" in plan.reason
