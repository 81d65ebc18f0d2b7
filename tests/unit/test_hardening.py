"""Bounded input, API keys, spill-file integrity and buffered store writes, without a model."""

from __future__ import annotations

import pytest

from core.config import Limits
from core.errors import InvalidRequest, RequestTooLarge, StoreUnavailable, Unauthorized
from core.policies import TurnParams
from gateway import chat_request
from gateway.auth import ANONYMOUS, ApiKeys
from gateway.chat_messages import depth
from gateway.serve_config import GatewayConfig
from sessions.ids import check_id
from sessions.kv.parked import HEADER, ParkedKV, frame, unframe
from sessions.metadata import MemoryStore
from sessions.store_writer import StoreWriter
from tests.support import until_async

ONE = [{"role": "user", "content": "x"}]


def parse(**body):
    return chat_request.parse_chat({"messages": ONE, **body}, TurnParams(), None, Limits(max_messages=4,
                                                                                     max_prompt_chars=100))


@pytest.mark.parametrize("body, words", [
    ({"specprefill": {"lookahead": 1.5}}, "specprefill.lookahead' must be an integer"),
    ({"specprefill": {"lookahead": 17}}, "[0, 16]"),
    ({"specprefill": {"break_even": False}}, "cannot be set per request"),
    ({"specprefill": {"min_tokens": 0}}, "cannot be set per request"),
    ({"specprefill": {"mass": "high"}}, "must be a number"),
    ({"n": True}, "'n' must be an integer"),
    ({"max_tokens": 0}, "'max_tokens' must be >= 1"),
    ({"model": 5}, "'model' must be a string"),
    ({"tool_choice": 3}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]}, "tool_calls must be a list"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]}, "function.name"),
    ({"messages": [{"role": "user", "content": {"a": 1}}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "r", "tool_call_id": 7}]}, "tool_call_id"),
])
def test_wrong_types_and_server_knobs_are_400s_naming_the_field(body, words):
    with pytest.raises(InvalidRequest) as info:
        parse(**body)
    assert words in str(info.value) and info.value.status == 400


def test_limits_answer_413_naming_the_limit():
    with pytest.raises(RequestTooLarge, match="max_messages"):
        parse(messages=ONE * 5)
    with pytest.raises(RequestTooLarge, match="max_prompt_chars"):
        parse(messages=[{"role": "user", "content": "y" * 101}])
    deep: dict = {"type": "object"}
    for _ in range(2000):  # far past any recursion limit: depth() must not recurse
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(RequestTooLarge, match="max_tool_depth"):
        parse(tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}])
    assert depth([[[]]], 10) == 3


def test_only_known_message_fields_are_kept_and_text_parts_are_joined():
    req = parse(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                           "evil": "x" * 50},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"},
                               "extra": 1}]}])
    assert req.messages == ({"role": "user", "content": "ab"},
                            {"role": "assistant", "content": None, "tool_calls": [
                                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
    ok = parse(specprefill={"lookahead": 2, "mass": 1})
    assert ok.params.prefill.lookahead == 2 and ok.params.prefill.selection.mass == 1.0


@pytest.mark.parametrize("bad", ["../../tmp/x", "a/b", "٣٣", "x" * 65, "", "a b", "é"])
def test_session_ids_are_short_ascii(bad):
    with pytest.raises(InvalidRequest):
        check_id(bad)
    assert check_id("agent_run-7") == "agent_run-7"


def test_api_keys_give_owners_and_refuse_strangers(tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# ops\nsk-file\n\n")
    keys = ApiKeys.from_config(GatewayConfig(api_keys=("sk-env",), api_keys_file=str(keyfile)))
    a, b = keys.owner("Bearer sk-env"), keys.owner("bearer sk-file")
    assert a != b and a.startswith("k") and ANONYMOUS not in (a, b)
    for header in (None, "", "Bearer", "Bearer sk-nope", "Basic sk-env"):
        with pytest.raises(Unauthorized):
            keys.owner(header)
    assert ApiKeys([]).owner(None) == ANONYMOUS


FP = b"target.gguf:1|spec.gguf:2"


def test_spill_frames_reject_tampering_truncation_and_other_models():
    blobs = (b"T" * 100, b"S" * 50)
    fp = ParkedKV(0, None, FP).fingerprint
    data = frame(blobs, fp)
    assert unframe(data, fp) == blobs
    for bad, words in ((data[:-1], "length"), (data[:10], "truncated"), (b"XXXX" + data[4:], "not a version"),
                       (data[:HEADER.size] + b"t" + data[HEADER.size + 1:], "checksum")):
        with pytest.raises(ValueError, match=words):
            unframe(bad, fp)
    with pytest.raises(ValueError, match="another model pair"):
        unframe(data, ParkedKV(0, None, b"other").fingerprint)
    keyed = frame(blobs, fp, b"deployment-secret")
    assert unframe(keyed, fp, b"deployment-secret") == blobs
    with pytest.raises(ValueError, match="checksum"):  # framed by anyone without the key
        unframe(keyed, fp, b"another-secret")


def test_a_damaged_spill_file_is_discarded_and_counted(tmp_path):
    kv = ParkedKV(budget_bytes=10, spill_dir=str(tmp_path), fingerprint=FP)
    kv.put("anonymous:a", (b"a" * 20, b"b" * 20))  # over budget: spilled
    (path,) = tmp_path.glob("*.kv")
    assert "anonymous" not in path.name and kv.where("anonymous:a") == "disk"
    path.write_bytes(path.read_bytes()[:-5])
    assert kv.take("anonymous:a") is None and kv.spill_rejected == 1 and not path.exists()
    kv.put("anonymous:b", (b"a" * 20, b"b" * 20))
    assert kv.take("anonymous:b") == (b"a" * 20, b"b" * 20)


def test_a_failed_spill_is_counted_not_raised(tmp_path):
    spill = tmp_path / "spill"
    kv = ParkedKV(budget_bytes=10, spill_dir=str(spill), fingerprint=FP)
    spill.rmdir()
    spill.write_text("a file where the directory was")  # every write below fails, even as root
    assert kv.put("k:a", (b"a" * 20, b"b")) == ["k:a"]
    assert kv.spill_failures == 1 and kv.where("k:a") == "none" and kv.take("k:a") is None


def test_spill_bytes_stay_under_their_cap_and_stale_files_are_cleared(tmp_path):
    (tmp_path / "old.kv").write_bytes(b"stale")
    one = len(frame((b"a" * 100, b""), bytes(32)))
    kv = ParkedKV(budget_bytes=0, spill_dir=str(tmp_path), fingerprint=FP, spill_budget_bytes=2 * one)
    assert not (tmp_path / "old.kv").exists()
    for i in range(5):
        kv.put(f"k:{i}", (b"a" * 100, b""))
    assert kv.bytes_on_disk <= 2 * one and len(list(tmp_path.glob("*.kv"))) == 2
    assert kv.where("k:0") == "none" and kv.where("k:4") == "disk"


class FlakyStore(MemoryStore):
    """The in-process store with an outage switch (the Redis outage itself is an integration test)."""

    def __init__(self) -> None:
        super().__init__(ttl_s=60)
        self.down = False

    async def save(self, session_id, meta):
        if self.down:
            raise StoreUnavailable("down")
        await super().save(session_id, meta)

    async def delete(self, session_id):
        if self.down:
            raise StoreUnavailable("down")
        return await super().delete(session_id)


async def test_store_writer_coalesces_replays_deletes_and_converges():
    store = FlakyStore()
    writer = StoreWriter(store)
    writer.start()
    store.down = True
    writer.save("k:a", {"v": 1})
    writer.save("k:a", {"v": 2})
    writer.save("k:b", {"v": 1})
    writer.delete("k:b")
    assert await until_async(lambda: writer.degraded, 5)  # its first write failed
    assert writer.pending == 2 and not await writer.flush(0.1)
    # reads see the queued writes: the newer save, and the delete
    assert await writer.load("k:a") == {"v": 2} and await writer.load("k:b") is None
    store.down = False
    assert await writer.flush(5)
    assert await store.load("k:a") == {"v": 2} and await store.load("k:b") is None
    assert not writer.degraded and writer.failed_writes >= 1
    await writer.stop()


async def test_the_store_writer_survives_a_record_it_cannot_write():
    """An exception that is not an outage (here a record orjson cannot encode) drops that
    record, logged, and the writer goes on: later records still land."""
    store = MemoryStore(60)
    writer = StoreWriter(store)
    writer.start()
    writer.save("k:bad", {"v": object()})
    writer.save("k:good", {"v": 1})
    assert await writer.flush(2)
    assert await store.load("k:good") == {"v": 1} and await store.load("k:bad") is None
    assert writer.dropped_writes == 1 and "TypeError" in (writer.last_error or "")
    writer.save("k:later", {"v": 2})
    assert await writer.flush(2) and await store.load("k:later") == {"v": 2}
    await writer.stop()


async def test_store_and_registry_errors_say_what_failed_not_where():
    """A 503 tells the client the store is down, never the Redis host and port behind it
    (logged instead); a 409 does not name the replica that owns a session."""
    from core.errors import OwnedElsewhere
    from gateway.error_responses import error_body
    from sessions.metadata import RedisStore
    from sessions.registry import RedisRegistry

    store = RedisStore("redis://127.0.0.1:1/0", ttl_s=60, timeout_s=0.2)
    registry = RedisRegistry(store.client, "replica-a", "http://127.0.0.1:9")
    for call in (lambda: store.load("k:a"), lambda: registry.claim("k:a")):
        with pytest.raises(StoreUnavailable) as caught:
            await call()
        status, body = error_body(caught.value)
        assert status == 503 and "127.0.0.1" not in body["error"]["message"] and ":1" not in body["error"]["message"]
    await store.close()
    busy = OwnedElsewhere("s1", "k:s1", "replica-b")
    assert "replica-b" not in error_body(busy)[1]["error"]["message"] and busy.replica_id == "replica-b"


@pytest.mark.parametrize("key", ["response_format", "text"])
def test_output_schemas_get_the_tool_schema_depth_bound(key):
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"x": deep}}
    if key == "response_format":
        fmt = {"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}
        body = {"messages": ONE, "response_format": fmt}
        call = lambda: chat_request.parse_chat(body, TurnParams(), None, Limits(max_tool_depth=16))  # noqa: E731
    else:
        from gateway.wire.openai_responses import parse as openai_responses
        body = {"input": "hi", "text": {"format": {"type": "json_schema", "name": "d", "schema": deep}}}
        call = lambda: openai_responses.parse_body(body, [], TurnParams(), Limits(max_tool_depth=16), 4096)  # noqa: E731
    with pytest.raises(RequestTooLarge, match="max_tool_depth"):
        call()


def test_replicas_sharing_a_spill_directory_keep_each_others_files(tmp_path):
    """A replica starting up clears its own earlier process's spills, never another's."""
    blobs = (b"t" * 200, b"s" * 100)
    a = ParkedKV(100, str(tmp_path), namespace="host-8081")  # a tiny RAM budget: everything spills
    a.put("k:s1", blobs)
    a.put("k:s2", blobs)
    ParkedKV(100, str(tmp_path), namespace="host-8082")  # another replica starts on the same directory
    assert a.take("k:s1") == blobs
    again = ParkedKV(100, str(tmp_path), namespace="host-8081")  # a's own restart clears a's leftovers
    assert a.take("k:s2") is None and again.spill_dir == tmp_path / "host-8081"
    assert ParkedKV(100, str(tmp_path), namespace="../x").spill_dir == tmp_path / ".._x"  # a name, never a path


def test_a_result_names_the_commit_it_came_from(tmp_path):
    import subprocess

    from core.machine import source_commit

    here = source_commit()
    assert len(here.split("+")[0]) == 40 and all(c in "0123456789abcdef" for c in here.split("+")[0])
    assert source_commit(tmp_path) == "unknown"  # not a checkout
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]
    (tmp_path / "f").write_text("1")
    for args in (["init", "-q"], ["add", "f"], ["commit", "-qm", "x"]):
        subprocess.run([*git, *args], cwd=tmp_path, check=True)
    clean = source_commit(tmp_path)
    (tmp_path / "f").write_text("2")
    assert source_commit(tmp_path) == clean + "+dirty"
