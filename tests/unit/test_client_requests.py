"""Request bodies recorded from the real coding agents (ops/record_clients.py; Claude Code
2.1.328, Codex CLI 0.169.0, opencode 1.18.33): each parses, keeps what has a meaning here,
and ignores the rest without refusing the request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.config import Limits
from core.errors import ConfigError, InvalidRequest
from core.policies import TurnParams
from gateway import chat_request, client_hints
from gateway.wire.anthropic import parse as anthropic_messages
from gateway.wire.openai_responses import parse as openai_responses

FIXTURES = Path(__file__).parent.parent / "fixtures" / "clients"
N_CTX = 32768


def recorded(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def parse(entry: dict, keep_billing: bool = False) -> chat_request.ChatRequest:
    """As the gateway's routes parse it, headers included."""
    body, headers = entry["body"], {k.lower(): v for k, v in entry["headers"].items()}
    hint = client_hints.header_hint(_Headers(headers))
    path = entry["path"].split("?")[0]
    if path.endswith("/v1/messages"):
        return anthropic_messages.parse_messages_body(body, TurnParams(), None, Limits(), N_CTX, hint, keep_billing)
    if path.endswith("/v1/responses"):
        return openai_responses.parse_body(body, [], TurnParams(), Limits(), N_CTX, hint).chat
    return chat_request.parse_chat(body, TurnParams(), None, Limits(), N_CTX, hint)


class _Headers(dict):
    """Case-insensitive lookups, as aiohttp's request headers are."""

    def get(self, key, default=None):  # type: ignore[override]
        return super().get(key.lower(), default)


ALL = sorted(p.name for p in FIXTURES.glob("*.json"))


def test_every_client_is_recorded():
    agents = {json.loads((FIXTURES / n).read_text())["headers"].get("User-Agent", "")
              or json.loads((FIXTURES / n).read_text())["headers"].get("user-agent", "") for n in ALL}
    assert any(a.startswith("claude-cli/2.1.328") for a in agents)
    assert any(a.startswith("codex_exec/0.169.0") for a in agents)
    assert any(a.startswith("opencode/1.18.33") for a in agents)


@pytest.mark.parametrize("name", ALL)
def test_a_recorded_request_parses_with_its_tools_and_messages(name):
    entry = recorded(name)
    req = parse(entry)
    assert req.messages and req.messages[-1]["role"] in ("user", "system")
    assert req.stream is True
    offered = entry["body"].get("tools") or []
    if offered:  # every client-side function survives; hosted and deferred tools are left out
        names = {t["function"]["name"] for t in req.tools or ()}
        assert len(names) >= len(offered) - 2 and names


def test_claude_code_keeps_its_system_entry_in_place_and_clamps_max_tokens():
    req = parse(recorded("claude_code_first.json"))
    roles = [m["role"] for m in req.messages]
    assert roles == ["system", "user", "system"]  # the environment context stays where Claude Code put it
    assert req.messages[2]["content"].startswith("# Environment")
    sampling = req.params.sampling
    assert sampling.max_tokens_asked == 128000 and sampling.max_tokens == Limits().max_tokens_cap
    assert "DeferredToolPlaceholder" not in {t["function"]["name"] for t in req.tools or ()}


def test_the_billing_line_is_stripped_unless_kept():
    first = parse(recorded("claude_code_first.json"))
    assert "x-anthropic-billing-header" not in first.messages[0]["content"]
    assert first.messages[0]["content"].startswith("You are a Claude agent")
    kept = parse(recorded("claude_code_first.json"), keep_billing=True)
    assert kept.messages[0]["content"].startswith("x-anthropic-billing-header: cc_version=2.1.328.")


def test_two_claude_code_conversations_share_everything_before_their_suffix():
    """Another conversation's billing line differs (``.b7f`` against ``.000``): stripped, the
    system prompts are identical, so their tokens can share one prefix."""
    entry = recorded("claude_code_first.json")
    other = json.loads(json.dumps(entry))
    line = other["body"]["system"][0]["text"]
    other["body"]["system"][0]["text"] = line.replace(line.split("cc_version=")[1].split(";")[0], "2.1.328.000")
    assert other["body"]["system"][0]["text"] != line
    assert parse(entry).messages[0] == parse(other).messages[0]
    assert parse(entry, True).messages[0] != parse(other, True).messages[0]


def test_a_resumed_claude_code_conversation_extends_the_first():
    first, resumed = parse(recorded("claude_code_first.json")), parse(recorded("claude_code_resumed.json"))
    assert list(resumed.messages[: len(first.messages)]) == list(first.messages)
    assert resumed.hint == first.hint


@pytest.mark.parametrize("name, hint", [
    ("claude_code_first.json", "X-Claude-Code-Session-Id"),
    ("codex_exec.json", "session-id"),
    ("opencode_turn.json", "x-session-id"),
])
def test_client_session_ids_become_hints(name, hint):
    entry = recorded(name)
    value = {k.lower(): v for k, v in entry["headers"].items()}[hint.lower()]
    assert parse(entry).hint == value
    assert parse(entry).session_id is None  # a hint, never SpecGate's exclusive session


def test_opencode_title_and_turn_share_a_hint_but_name_no_session():
    title, turn = parse(recorded("opencode_title.json")), parse(recorded("opencode_turn.json"))
    assert title.hint == turn.hint and title.session_id is None and turn.session_id is None
    assert title.tools is None and turn.tools and len(turn.tools) == 10


def test_codex_developer_messages_are_system_and_hosted_tools_are_left_out():
    entry = recorded("codex_exec.json")
    req = parse(entry)
    assert [m["role"] for m in req.messages][:2] == ["system", "system"]
    kinds = {t.get("type") for t in entry["body"]["tools"]}
    assert {"namespace", "web_search"} <= kinds
    assert all(t["type"] == "function" for t in req.tools or ())
    assert req.params.sampling.max_tokens == Limits().default_max_tokens  # Codex sets no max_output_tokens


def test_metadata_user_id_as_json_gives_its_session_id():
    user_id = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "abc-123"})
    assert client_hints.anthropic_user_hint(user_id) == "abc-123"
    assert client_hints.anthropic_user_hint("plain-user") == "plain-user"
    assert client_hints.anthropic_user_hint("x" * 300).startswith("sha256:")  # long: kept by digest, not refused


def test_a_long_prompt_cache_key_is_a_digest_not_a_refusal():
    req = chat_request.parse_chat({"messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": "k" * 400},
                              TurnParams(), None)
    assert req.hint is not None and req.hint.startswith("sha256:")


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_over_the_cap_is_clamped_not_refused(key):
    limits = Limits(max_tokens_cap=1000)
    req = chat_request.parse_chat({"messages": [{"role": "user", "content": "hi"}], key: 5000}, TurnParams(), None,
                              limits)
    assert req.params.sampling.max_tokens == 1000 and req.params.sampling.max_tokens_asked == 5000


def test_max_output_tokens_is_clamped_on_responses():
    req = openai_responses.parse_body({"input": "hi", "max_output_tokens": 10**6}, [], TurnParams(),
                                      Limits(max_tokens_cap=2048), N_CTX)
    assert req.chat.params.sampling.max_tokens == 2048


def test_the_billing_line_pattern_is_anchored():
    assert client_hints.strip_billing_line("x-anthropic-billing-header: cc_version=1; cch=abcde;\nrest") == \
        ("rest", True)
    text = "You are helpful.\nx-anthropic-billing-header: cc_version=1;"
    assert client_hints.strip_billing_line(text) == (text, False)  # only at the head


LOOKBEHIND_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}}


def test_a_tool_schema_the_grammar_cannot_compile_never_fails_an_auto_request():
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [LOOKBEHIND_TOOL]}
    req = chat_request.parse_chat(body, TurnParams(), None)
    assert req.tools and req.params.sampling.constraint is None  # parsed afterwards, unconstrained
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):  # a forced call stays enforced
        with pytest.raises(InvalidRequest, match="cannot be enforced"):
            chat_request.parse_chat({**body, "tool_choice": choice}, TurnParams(), None)


@pytest.mark.parametrize("route", ["messages", "responses"])
def test_decoding_extensions_reach_the_turn_on_every_protocol(route):
    """``speculative`` and ``specattn`` are read on the Anthropic and Responses routes as on Chat
    Completions (they were ignored there), with the same checks."""
    def parse_with(extra: dict) -> chat_request.ChatRequest:
        if route == "messages":
            body = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **extra}
            return anthropic_messages.parse_messages_body(body, TurnParams(), None, Limits(), N_CTX)
        return openai_responses.parse_body({"input": "hi", **extra}, [], TurnParams(), Limits(), N_CTX).chat

    assert parse_with({}).params.decoding.mode.value == "plain"
    spec = parse_with({"speculative": {"gamma": 3}}).params.decoding
    assert spec.mode.value == "speculative" and spec.gamma == 3
    sparse = parse_with({"specattn": {"p": 0.9}}).params.decoding
    assert sparse.mode.value == "specattn" and sparse.specattn_p == 0.9
    with pytest.raises(ConfigError, match="gamma"):  # a 400 invalid_parameter, as on Chat Completions
        parse_with({"speculative": {"gamma": 99}})


def test_speculative_false_asks_for_plain_decoding_on_a_decode_auto_server():
    from core.loader import override
    from core.policies import DecodingPolicy

    auto = override(DecodingPolicy(), decode_auto=True)
    assert chat_request.parse_decoding(auto, {}).decode_auto  # no mode named: the server picks
    assert chat_request.parse_decoding(auto, {"speculative": True}).mode.value == "speculative"
    plain = chat_request.parse_decoding(auto, {"speculative": False})
    assert plain.mode.value == "plain" and not plain.decode_auto
