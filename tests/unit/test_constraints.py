"""Output constraints without a model: which grammar a request gets, that it compiles (and
what a bad schema is told), and the parsing of calls small models write unconstrained."""

from __future__ import annotations

import llguidance
import pytest

from core import constraints
from core.errors import InvalidRequest
from core.policies import TurnParams
from gateway import chat_messages, chat_request, tool_calls

QWEN = constraints.SYNTAXES["qwen"]
TOOLS = (
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Bergen"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer"}}, "required": ["hour"]}}},
)
ASK = [{"role": "user", "content": "x"}]


def accepts(constraint: constraints.Constraint, text: str) -> bool:
    """Whether the grammar (tags spelled as text) accepts ``text`` whole, byte by byte."""
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    matcher = llguidance.LLMatcher(tokenizer, constraint.grammar(special=False), log_level=0)
    ok = matcher.consume_tokens(list(text.encode()))
    return ok and not matcher.is_error() and matcher.is_accepting()


class _ByteTokenizer:
    """One token per byte, and an EOS: enough to walk a grammar over text."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


def test_required_and_named_calls_take_only_offered_tools_with_valid_arguments():
    required = constraints.tool_call(list(TOOLS), "required", False, QWEN)
    named = constraints.tool_call(list(TOOLS), "set_alarm", False, QWEN)
    assert required is not None and named is not None and not required.lazy
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert accepts(required, good)
    assert not accepts(required, good.replace("Oslo", "Paris"))  # outside the tool's enum
    assert not accepts(required, good.replace("get_weather", "rm_rf"))  # not offered
    assert not accepts(named, good)  # the named function only
    assert accepts(named, '<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7}}\n</tool_call>')


def test_parallel_false_allows_one_call_and_auto_is_lazy():
    one = '<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7}}\n</tool_call>'
    single = constraints.tool_call(list(TOOLS), "required", False, QWEN)
    parallel = constraints.tool_call(list(TOOLS), "required", True, QWEN)
    assert single is not None and parallel is not None
    assert accepts(parallel, one + "\n" + one) and not accepts(single, one + "\n" + one)
    named = constraints.tool_call(list(TOOLS), "set_alarm", True, QWEN)
    assert named is not None and accepts(named, one) and not accepts(named, one + "\n" + one)  # once, always
    auto = constraints.tool_call(list(TOOLS), "auto", True, QWEN)
    assert auto is not None and auto.lazy  # starts after the tag the model chose to write
    assert accepts(auto, one.removeprefix("<tool_call>"))
    assert constraints.tool_call(list(TOOLS), "none", True, QWEN) is None


def test_special_tags_are_named_as_tokens_or_spelled_as_text():
    c = constraints.tool_call(list(TOOLS), "required", False, QWEN)
    assert c is not None
    assert "calls: <tool_call> rest" in c.grammar(special=True)
    assert 'calls: "<tool_call>" rest' in c.grammar(special=False)


def test_json_reply_validates_against_the_schema():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    c = constraints.json_reply(schema)
    assert c.kind == "json_schema" and accepts(c, '{"ok": true}')
    assert not accepts(c, '{"ok": 1}') and not accepts(c, '{"ok": true, "x": 2}')
    assert accepts(constraints.json_reply(None), '{"anything": [1, 2]}')


def test_an_uncompilable_schema_is_a_400_naming_the_construct():
    with pytest.raises(InvalidRequest, match="no-such-format"):
        constraints.check(constraints.json_reply({"type": "string", "format": "no-such-format"}))


def parse(**body):
    return chat_request.parse_chat({"messages": ASK, **body}, TurnParams(), None).params.sampling.constraint


def test_which_constraint_a_chat_request_gets():
    assert parse(tools=list(TOOLS)).kind == "tool_call" and parse(tools=list(TOOLS)).lazy  # auto: lazy
    assert not parse(tools=list(TOOLS), tool_choice="required").lazy
    assert parse(tools=list(TOOLS), tool_choice="required", response_format={"type": "json_object"}).kind \
        == "tool_call"  # a forced call wins over response_format
    assert parse(tools=list(TOOLS), response_format={"type": "json_object"}).kind == "json_or_tool_call"
    assert parse(response_format={"type": "json_object"}).kind == "json_object"
    assert parse(response_format={"type": "text"}) is None and parse() is None
    assert parse(tools=list(TOOLS), tool_choice="none") is None


@pytest.mark.parametrize("body, needle", [
    ({"tool_choice": "required"}, "offers no tools"),
    ({"tools": list(TOOLS), "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"tool_choice": "sometimes", "tools": list(TOOLS)}, "'tool_choice' must be"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
])
def test_bad_constraints_are_400s(body, needle):
    with pytest.raises(InvalidRequest, match=needle):
        parse(**body)


def test_calls_in_the_forms_small_models_write():
    names = {"get_weather"}
    for text in ('{{"name": "get_weather", "arguments": {"city": "Oslo"}}}',  # the template's example form
                 '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```',
                 '<tool_call>\n{{"name": "get_weather", "arguments": {"city": "Oslo"}}}\n</tool_call>',
                 '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'):
        content, calls = tool_calls.parse(text, names)
        assert [c["function"]["name"] for c in calls] == ["get_weather"], text
        assert '"city"' in calls[0]["function"]["arguments"]


def test_the_developer_role_is_a_system_message_and_text_parts_join():
    assert chat_messages.parse_message({"role": "developer", "content": "Be terse."}, 0)["role"] == "system"
    assert chat_messages.join_text([{"type": "input_text", "text": "a"}, {"type": "refusal", "refusal": "b"}], "c",
                              ("input_text", "refusal")) == "ab"
    # a part no text model reads is a placeholder, never a refusal (an agent's tool may return a screenshot)
    assert chat_messages.join_text([{"type": "input_text", "text": "see: "}, {"type": "input_image"}], "c",
                              ("input_text",)) == "see: [input_image omitted: this server's models read text only]"
    with pytest.raises(InvalidRequest, match="'audio' parts are not supported"):
        chat_messages.join_text([{"type": "audio"}], "c", ("input_text",))
