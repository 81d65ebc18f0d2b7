"""The token-block index that finds the conversation a request without a session id continues."""

import pytest

from sessions.conversations import ConversationIndex, chain


def test_chain_covers_whole_blocks_only_and_depends_on_everything_before() -> None:
    a = chain("k", list(range(70)), block=32)
    assert len(a) == 2  # 70 tokens: two whole blocks, the tail is not hashed
    b = chain("k", [999, *range(1, 70)], block=32)
    assert a[0] != b[0] and a[1] != b[1]  # a change in block 0 changes every later hash
    c = chain("k", [*range(40), 7, *range(41, 70)], block=32)
    assert a[0] == c[0] and a[1] != c[1]


def test_lookup_returns_the_longest_holder_first() -> None:
    idx = ConversationIndex(block=4)
    base = list(range(16))
    idx.put("short", "k", base[:8])
    idx.put("long", "k", base + [100, 101, 102, 103])
    idx.put("other", "k", [50, 51, 52, 53, 54, 55, 56, 57])
    assert idx.lookup("k", base + [100, 101, 102, 103, 104]) == [("long", 20), ("short", 8)]
    assert idx.lookup("k", [1, 2, 3, 4]) == []  # differs in the first block: nobody


def test_another_owner_never_matches() -> None:
    idx = ConversationIndex(block=4)
    idx.put("a-conv", "key-a", list(range(32)))
    assert idx.lookup("key-b", list(range(32))) == []
    assert idx.lookup("key-a", list(range(32))) == [("a-conv", 32)]


def test_put_replaces_and_remove_forgets() -> None:
    idx = ConversationIndex(block=4)
    idx.put("s", "k", list(range(12)))
    idx.put("s", "k", [9, 9, 9, 9, *range(8)])  # the conversation was rewritten from its start
    assert idx.lookup("k", list(range(12))) == []
    assert idx.lookup("k", [9, 9, 9, 9]) == [("s", 4)]
    idx.remove("s")
    assert idx.lookup("k", [9, 9, 9, 9]) == [] and len(idx) == 0
    idx.remove("s")  # twice is harmless


def test_a_branch_is_found_up_to_the_branch_point() -> None:
    idx = ConversationIndex(block=4)
    history = list(range(12))
    idx.put("s", "k", history + [20, 21, 22, 23])
    assert idx.lookup("k", history + [30, 31, 32, 33]) == [("s", 12)]


def test_prompt_shorter_than_a_block_finds_nothing_and_block_is_validated() -> None:
    idx = ConversationIndex(block=4)
    idx.put("s", "k", [1, 2])  # nothing whole to file
    assert len(idx) == 0 and idx.lookup("k", [1, 2]) == []
    with pytest.raises(ValueError):
        ConversationIndex(block=0)
