"""The directory KV tier without a model: entries round-trip, are shared by two tiers on one
folder (two replicas, or a restart), and a file that fails a check -- truncated, flipped --
is deleted and reported missing, never returned, while another model pair's tier never sees
it; the folder stays within its byte budget, least recently used first."""

from __future__ import annotations

import os

from sessions.kv.tier import DirectoryTier, TierSettings

BLOBS = (b"target-kv" * 100, b"speculator-kv" * 50)


def written(tier: DirectoryTier, key: str, blobs: tuple[bytes, bytes] = BLOBS) -> None:
    tier.put(key, blobs)
    tier.flush()  # the writes before it have landed


def test_an_entry_round_trips_and_another_tier_on_the_folder_finds_it(tmp_path):
    a = DirectoryTier(tmp_path, TierSettings(b"pair-1", 1 << 20, b"secret"))
    assert a.get("k") is None and a.misses == 1
    written(a, "k")
    b = DirectoryTier(tmp_path, TierSettings(b"pair-1", 1 << 20, b"secret"))  # a restarted process, or another replica
    assert b.get("k") == BLOBS and b.hits == 1
    assert [p.suffix for p in a.dir.iterdir()] == [".kv"]  # no partial file left
    a.close()
    b.close()


def test_a_damaged_or_foreign_file_is_deleted_and_never_loaded(tmp_path):
    tier = DirectoryTier(tmp_path, TierSettings(b"pair-1", 1 << 20, b"secret"))
    for damage in (lambda d: d[: len(d) // 2], lambda d: d[:-1] + bytes([d[-1] ^ 1])):
        written(tier, "k")
        path = tier.path("k")
        path.write_bytes(damage(path.read_bytes()))
        assert tier.get("k") is None and not path.exists()
    written(tier, "k")
    other = DirectoryTier(tmp_path, TierSettings(b"pair-2", 1 << 20, b"secret"))  # another model pair or KV type
    assert other.get("k") is None and other.rejected == 0 and tier.rejected == 2  # its own folder: never seen
    assert other.dir != tier.dir and tier.get("k") == BLOBS
    tier.close()
    other.close()


def test_the_folder_stays_within_its_budget_least_recently_used_first(tmp_path):
    one = len(BLOBS[0]) + len(BLOBS[1]) + 100  # an entry with its header
    tier = DirectoryTier(tmp_path, TierSettings(b"pair-1", 2 * one, b"secret"))
    written(tier, "a")
    written(tier, "b")
    os.utime(tier.path("a"), (2, 2))
    os.utime(tier.path("b"), (1, 1))
    assert tier.get("b") == BLOBS and tier.path("b").stat().st_mtime > 2  # a read makes it the newest
    written(tier, "c")
    assert not tier.path("a").exists() and tier.get("b") == BLOBS and tier.get("c") == BLOBS
    assert tier.bytes_used <= 2 * one
    tier.close()


class SlowReads(DirectoryTier):
    """A tier whose body reads take ``delay_s`` (a busy Redis, a slow disk)."""

    delay_s = 0.4

    def _read(self, name: str) -> bytes | None:
        import time

        time.sleep(self.delay_s)
        return super()._read(name)


def test_a_large_entry_gets_the_time_its_size_needs_and_a_small_one_does_not(tmp_path):
    """A lookup answers within the tier's deadline, but an entry's read gets its size's time
    on top (READ_FLOOR_BPS): a deep session's checkpoint is hundreds of MB, and recomputing it
    costs minutes.  A small entry read as slowly misses at the deadline."""
    from sessions.kv.tier import READ_FLOOR_BPS

    s = TierSettings(b"pair-1", 64 << 20, b"secret", timeout_s=0.1)
    large = (os.urandom(READ_FLOOR_BPS // 2), b"s")  # half a second's worth at the floor
    written(DirectoryTier(tmp_path, s), "large", large)
    written(DirectoryTier(tmp_path, s), "small")
    slow = SlowReads(tmp_path, s)
    assert slow.read_deadline_s(len(large[0])) > 0.5
    assert slow.get("large") == large and slow.timeouts == 0
    assert slow.get("small") is None and slow.timeouts == 1  # 0.4 s against 0.1 s and a few bytes' time
    slow.close()
