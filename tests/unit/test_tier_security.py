"""The KV tier's files as an attacker on the same machine would meet them (issue 51, point 3):
private modes, entries and notes written without the deployment's secret refused and counted,
nothing read through a symlink or past its size cap, a killed writer's temporary files removed
at start-up, a deleted session's checkpoint gone with nothing queued bringing it back, and a
writer queue bounded in bytes."""

from __future__ import annotations

import os
import stat
import time

from sessions.kv.checkpoints import SessionCheckpoints
from sessions.kv.parked import frame
from sessions.kv.prefixes import PrefixCache
from sessions.kv.tier import DirectoryTier, TierSettings
from sessions.kv.tier_secret import tier_secret

BLOBS = (b"target-kv" * 100, b"speculator-kv" * 50)
TOKENS = tuple(range(100, 400))


def tier(root, secret: bytes = b"secret", **kw) -> DirectoryTier:
    return DirectoryTier(root, TierSettings(b"pair", kw.pop("budget", 1 << 20), secret, **kw))


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_folders_are_0700_and_files_0600(tmp_path):
    root = tmp_path / "tier"
    t = tier(root)
    t.put("k", BLOBS)
    t.write_note("n", b"{}")
    t.flush()
    assert {mode(d) for d in (root, t.dir.parent, t.dir, t.notes)} == {0o700}
    assert mode(t.path("k")) == 0o600 and mode(t.notes / "n") == 0o600
    t.close()


def test_an_entry_or_note_written_without_the_secret_is_refused_and_counted(tmp_path):
    t = tier(tmp_path)
    forged = frame(BLOBS, t.fingerprint, b"a guess")  # the right layout, the wrong key
    t.path("k").write_bytes(forged)
    assert t.get("k") is None and t.rejected == 1 and not t.path("k").exists()
    other = tier(tmp_path, secret=b"another deployment")  # the same folder, another secret
    other.put("k", BLOBS)
    other.flush()
    assert t.get("k") is None and t.rejected == 2
    (t.notes / "n").write_bytes(b"\0" * 16 + b'{"tokens": [1], "key": "x"}')
    assert t.read_note("n") is None and t.rejected == 3
    t.write_note("n", b"mine")
    assert t.note("n") == b"mine" and other.read_note("n") is None
    t.close()
    other.close()


def test_nothing_is_read_through_a_symlink_or_past_its_cap(tmp_path):
    t = tier(tmp_path, budget=4096)
    secret_file = tmp_path / "elsewhere"
    secret_file.write_bytes(b"not the tier's")
    t.path("k").symlink_to(secret_file)
    assert t.get("k") is None and t.rejected == 1 and secret_file.exists() and not t.path("k").is_symlink()
    with open(t.path("big"), "wb") as f:
        f.truncate(1 << 30)  # a 1 GiB file (sparse): refused before a byte is read
    assert t.get("big") is None and t.rejected == 2
    t.close()


def test_a_killed_writers_partial_files_are_removed_at_start_up_and_counted(tmp_path):
    first = tier(tmp_path)
    first.close()  # its start-up sweep done (on its writer thread): the files below come after it
    stale, fresh = first.dir / "abc.1234.partial", first.notes / "n.5678.partial"
    for path in (stale, fresh):
        path.write_bytes(b"half an entry")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    again = tier(tmp_path)  # a restart
    assert again.partials_removed == 1 and not stale.exists()
    assert fresh.exists()  # a replica on the same folder may be writing it now
    again.close()


def test_a_deleted_sessions_checkpoint_goes_and_a_queued_index_write_cannot_bring_it_back(tmp_path):
    t = tier(tmp_path)
    cp = SessionCheckpoints(t, min_new_tokens=16)
    cp.write("alice:s1", "alice", TOKENS, BLOBS)
    cp.forget("alice:s1", "alice")  # deleted while its write is still queued
    t.flush()
    assert cp.find("alice:s1", "alice", (*TOKENS, 1)) is None
    assert not t.path(PrefixCache.key("alice", TOKENS)).exists() and not any(t.notes.iterdir())
    cp.write("alice:s2", "alice", TOKENS, BLOBS)
    t.flush()
    cp.forget("alice:s2", "alice")  # deleted after its write landed
    t.flush()
    assert not t.path(PrefixCache.key("alice", TOKENS)).exists() and not any(t.notes.iterdir())
    assert cp.recent("alice") == []
    t.close()


def test_the_write_queue_is_bounded_in_bytes(tmp_path):
    size = len(BLOBS[0]) + len(BLOBS[1])
    t = tier(tmp_path, queue_bytes=size + 10)
    t._writer.submit(time.sleep, 0.3)  # the writer busy: writes queue up
    assert t.put("a", BLOBS) and not t.put("b", BLOBS)
    assert t.skipped == 1
    t.flush()
    assert t.get("a") == BLOBS and t.get("b") is None and t.queued_bytes == 0
    t.close()
    assert not t.put("c", BLOBS) and t.skipped == 2  # after close: skipped, never raised


def test_the_secret_is_generated_once_private_and_shared_by_processes_on_one_cache(tmp_path):
    first = tier_secret("", tmp_path)
    assert len(first) == 64 and mode(tmp_path / "kv-tier.secret") == 0o600
    assert tier_secret("", tmp_path) == first
    assert tier_secret("given", tmp_path) == b"given"
