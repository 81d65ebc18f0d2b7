"""Session checkpoints in the KV tier without a model: the index follows the entry, a
checkpoint serves only a prompt that starts with its exact tokens (and is shorter than it),
a newer one replaces the older entry, another tier on the folder (a replica) finds it, and a
deleted session's index goes."""

from __future__ import annotations

from sessions.kv.checkpoints import SessionCheckpoints
from sessions.kv.prefixes import PrefixCache
from sessions.kv.tier import DirectoryTier, TierSettings

BLOBS = (b"target" * 64, b"scorer" * 32)
TOKENS = tuple(range(100, 400))  # 300 tokens


def tiers(tmp_path) -> tuple[DirectoryTier, SessionCheckpoints]:
    tier = DirectoryTier(tmp_path, TierSettings(b"pair", 1 << 20, b"secret"))
    return tier, SessionCheckpoints(tier, min_new_tokens=256)


def test_a_checkpoint_serves_a_prompt_that_starts_with_its_tokens_on_another_replica(tmp_path):
    tier, mine = tiers(tmp_path)
    assert mine.due("alice:s1", 300)
    mine.write("alice:s1", "alice", TOKENS, BLOBS)
    tier.flush()
    assert not mine.due("alice:s1", 400) and mine.due("alice:s1", 556) and mine.written == 1
    _, theirs = tiers(tmp_path)  # a replica on the same folder
    assert theirs.find("alice:s1", "alice", (*TOKENS, 7, 8)) == (300, 300, BLOBS)
    assert theirs.find("alice:s1", "alice", (*TOKENS[:250], 9, 9)) == (300, 250, BLOBS)  # parts at 250
    assert theirs.find("alice:s1", "alice", TOKENS) is None  # nothing left to prefill
    assert theirs.find("alice:s1", "alice", (1, *TOKENS[1:], 7)) is None  # other tokens from the start
    assert theirs.find("alice:s1", "bob", (*TOKENS, 7)) is None  # another key's conversation
    assert theirs.find("alice:s2", "alice", (*TOKENS, 7)) is None  # another session


def test_a_newer_checkpoint_replaces_the_older_entry_and_delete_drops_the_index(tmp_path):
    tier, cp = tiers(tmp_path)
    cp.write("alice:s1", "alice", TOKENS, BLOBS)
    longer = (*TOKENS, *range(500, 800))
    cp.write("alice:s1", "alice", longer, (b"t2", b"s2"))
    tier.flush()
    assert not tier.path(PrefixCache.key("alice", TOKENS)).exists()
    assert cp.find("alice:s1", "alice", (*longer, 1)) == (600, 600, (b"t2", b"s2"))
    cp.forget("alice:s1", "alice")
    tier.flush()  # forgetting is the writer's job, after what was queued before it
    assert cp.find("alice:s1", "alice", (*longer, 1)) is None and not any(tier.notes.iterdir())
    assert not any(tier.dir.iterdir())  # the entry goes with its index


def test_an_index_whose_entry_is_gone_finds_nothing(tmp_path):
    tier, cp = tiers(tmp_path)
    cp.write("alice:s1", "alice", TOKENS, BLOBS)
    tier.flush()
    tier.path(PrefixCache.key("alice", TOKENS)).unlink()  # evicted by the tier's budget
    assert cp.find("alice:s1", "alice", (*TOKENS, 1)) is None


def test_an_owners_note_lists_its_latest_checkpoints_and_forgets_deleted_ones(tmp_path):
    """What a new conversation on a replica may start from: the owner's latest checkpoints,
    newest first, one per session, never another owner's, none of a deleted session."""
    tier, cp = tiers(tmp_path)
    other = (*TOKENS[:200], *range(900, 1000))
    cp.write("alice:s1", "alice", TOKENS, BLOBS)
    cp.write("alice:s2", "alice", other, BLOBS)
    cp.write("alice:s1", "alice", (*TOKENS, 5), BLOBS)  # s1 again: it moves to the front, once
    cp.write("bob:s9", "bob", TOKENS, BLOBS)
    tier.flush()
    replica_tier, replica = tiers(tmp_path)
    assert [len(t) for t, _ in replica.recent("alice")] == [301, 300]
    assert [t for t, _ in replica.recent("bob")] == [TOKENS]
    assert replica.recent("carol") == []
    replica.forget("alice:s1", "alice")
    replica_tier.flush()
    assert [t for t, _ in replica.recent("alice")] == [other]
    replica.forget("alice:s2", "alice")
    replica_tier.flush()
    assert replica.recent("alice") == [] and replica.recent("bob") != []


def test_the_best_lender_shares_the_system_prompt_and_gives_the_most_past_it(tmp_path):
    tier, cp = tiers(tmp_path)
    system, note = tuple(range(100, 400)), tuple(range(2000, 2300))
    short = (*system, 7, 7)  # shares only the system prompt
    sibling = (*system, 5, 5, 5, *note, 9)  # another task, then the same note
    stranger = (*range(5000, 5300), *note)  # the note, but not the system prompt
    for sid, tokens in (("alice:a", short), ("alice:b", sibling), ("alice:c", stranger)):
        cp.write(sid, "alice", tokens, BLOBS)
    tier.flush()
    prompt = (*system, 8, 8, 8, 8, *note, 1)
    assert cp.best_lender("alice", prompt, 300, 256, 64) == (sibling, PrefixCache.key("alice", sibling))
    assert cp.best_lender("alice", prompt, 300, 0, 64) is None  # no splicing: none beats the prefix entry
    assert cp.best_lender("bob", prompt, 300, 256, 64) is None
