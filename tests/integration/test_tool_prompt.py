"""Tools reach the prompt of a model whose chat template has no tool section (SmolLM2's):
counted by ``count_tokens`` and seen in the rendered prompt, through the generic section."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.support import start_gateway

FIXTURE = Path(__file__).parent.parent / "fixtures" / "clients" / "claude_code_first.json"


@pytest.fixture(scope="module")
def smol_gateway(small_model: Path):
    server = start_gateway(small_model, small_model)
    yield server
    server.stop()


def test_count_tokens_grows_with_the_tools_a_claude_code_request_offers(smol_gateway):
    body = json.loads(FIXTURE.read_text())["body"]
    with_tools = httpx.post(smol_gateway.base + "/v1/messages/count_tokens", json=body, timeout=60)
    without = httpx.post(smol_gateway.base + "/v1/messages/count_tokens",
                         json={k: v for k, v in body.items() if k != "tools"}, timeout=60)
    assert with_tools.status_code == without.status_code == 200, with_tools.text
    # 11 runnable tools of ~30K characters: thousands of tokens, not zero
    assert with_tools.json()["input_tokens"] > without.json()["input_tokens"] + 5000


def test_the_generic_tool_section_is_in_the_prompt(smol_engine):
    chat = smol_engine.chat
    assert chat.renders_tools is False  # SmolLM2's template ignores tools
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                               "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Read a.txt"}]
    prompt = chat.render_chat(messages, tools)
    text = smol_engine.target.detokenize(list(prompt.tokens), special=True)
    assert "<tools>" in text and '"read_file"' in text and "<tool_call>" in text
    assert len(prompt.tokens) > len(chat.render_chat(messages, None).tokens) + 50
    assert prompt.has_tools


def test_two_claude_code_conversations_share_their_system_prompt_and_tools_on_tokens(tiny_engine):
    """Two recorded conversations (billing lines ``.b7f`` and ``.ccf``), as the gateway parses and
    renders them: their tokens agree up to the first user message; with the billing line kept
    they part within the first few tokens."""
    from core.spans import common_prefix
    from tests.unit.test_client_requests import parse, recorded

    def tokens(name: str, keep: bool) -> tuple[tuple[int, ...], int]:
        req = parse(recorded(name), keep_billing=keep)
        prompt = tiny_engine.chat.render_chat(req.messages, req.tools)
        first_user = next(s.start for s in prompt.spans if s.role == "user")
        return prompt.tokens, first_user

    (a, user_a), (b, user_b) = tokens("claude_code_first.json", False), tokens("claude_code_second.json", False)
    assert user_a == user_b > 8000  # ~9K tokens of system prompt and tools before the user's first word
    assert common_prefix(a, b) >= user_a
    kept_a, kept_b = tokens("claude_code_first.json", True)[0], tokens("claude_code_second.json", True)[0]
    assert common_prefix(kept_a, kept_b) < 40
