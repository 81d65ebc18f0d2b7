"""What the Responses store keeps, and for how long: only the function tools a response
called, within a byte cap per conversation (older bodies go first, and stay continuable),
and the earlier responses of a conversation whose history a request resent instead of
naming ``previous_response_id``.  Through the openai client, unchanged; Redis holds the
records."""

from __future__ import annotations

import openai
import orjson
import pytest

from core.config import Limits
from tests.support import start_gateway

CAP = 8000
# an enum bounds the forced call: a tiny model writes a free string on and on
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "name": f"tool_{i}", "description": "An unused tool.", "parameters": WEATHER}
         for i in range(12)] + [{"type": "web_search"}]
INSTRUCTIONS = "You are a careful assistant. " * 100  # ~2.8 KB, echoed in every stored body


@pytest.fixture(scope="module")
def gw(tiny_target, tiny_speculator, redis_server):
    server = start_gateway(tiny_target, tiny_speculator, redis_url=redis_server.url,
                           limits=Limits(max_stored_response_bytes=CAP, default_max_tokens=256))
    yield server
    server.stop()


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base + "/v1", api_key="unused", max_retries=0)


def record(redis_server, resp_id: str) -> dict:
    sid = "conv-" + resp_id.split("_")[1]
    return orjson.loads(redis_server.client.get(f"specgate:session:anonymous:{sid}"))


def test_a_stored_response_keeps_only_the_tools_it_called(gw, redis_server):
    r = client(gw).responses.create(model="m", input="Weather in Oslo?", tools=TOOLS, max_output_tokens=80,
                                    tool_choice={"type": "function", "name": "tool_7"})
    assert [item.type for item in r.output] == ["function_call"] and r.output[0].name == "tool_7"
    assert len(r.tools) == len(TOOLS)  # the answer echoes the request, as OpenAI's does
    (entry,) = record(redis_server, r.id)["responses"]
    assert [t["name"] for t in entry["body"]["tools"]] == ["tool_7"]  # hosted and unused tools are not kept
    assert [t.name for t in client(gw).responses.retrieve(r.id).tools] == ["tool_7"]


def test_stored_bodies_stay_within_the_cap_newest_first_and_old_ones_still_continue(gw, redis_server):
    c = client(gw)
    ids = [c.responses.create(model="m", instructions=INSTRUCTIONS, input="Note one.", max_output_tokens=2).id]
    for text in ("Note two.", "Note three.", "Note four."):
        ids.append(c.responses.create(model="m", instructions=INSTRUCTIONS, input=text, max_output_tokens=2,
                                      previous_response_id=ids[-1]).id)
    entries = record(redis_server, ids[-1])["responses"]
    assert [e["id"] for e in entries] == ids
    kept = [e for e in entries if e["body"] is not None]
    assert sum(len(orjson.dumps(e["body"])) for e in kept) <= CAP and kept and kept[-1]["id"] == ids[-1]
    assert c.responses.retrieve(ids[-1]).id == ids[-1]
    with pytest.raises(openai.NotFoundError, match="no longer stored in full"):
        c.responses.retrieve(ids[0])
    branch = c.responses.create(model="m", instructions=INSTRUCTIONS, input="Back to one.", max_output_tokens=2,
                                previous_response_id=ids[0])  # continuing needs only its place in the history
    assert branch.usage.input_tokens_details.cached_tokens > 0


def test_a_resent_history_keeps_the_responses_it_still_matches(gw):
    c = client(gw)
    first_input = [{"role": "user", "content": "Log 1: pump 3 ran 40 minutes. Log 2: pump 1 ran 9 minutes. "
                                               "Which pump ran longest?"}]
    r1 = c.responses.create(model="m", input=first_input, max_output_tokens=4)
    resent = [*first_input, *[item.model_dump(exclude_none=True) for item in r1.output],
              {"role": "user", "content": "And the shortest?"}]
    r2 = c.responses.create(model="m", input=resent, max_output_tokens=4)  # no previous_response_id
    assert r2.id.split("_")[1] == r1.id.split("_")[1]  # matched by its tokens: the same conversation
    assert c.responses.retrieve(r1.id).id == r1.id  # and its earlier response is still there
    assert c.responses.retrieve(r2.id).id == r2.id
