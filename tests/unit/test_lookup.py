"""Prompt-lookup drafts (core/decoding/lookup.py), without a model: the longest suffix found
earlier, its most recent occurrence, what followed it, and k adapting to acceptance."""

from __future__ import annotations

from core.decoding.drafts import K_MAX, K_MIN, Drafter, Lookup, copy_views


def test_the_longest_suffix_found_earlier_gives_what_followed_its_latest_occurrence():
    d = Drafter([1, 2, 3, 4, 5, 9, 9, 2, 3, 4, 6, 7, 8, 2, 3], max_ngram=4, min_ngram=2)
    assert d.propose(3) == [4, 6, 7]  # "2 3" last seen before the end at index 7: then 4 6 7
    d.extend([4])  # "2 3 4" now: its latest earlier occurrence is also at 7
    assert d.propose(8) == [6, 7, 8, 2, 3, 4]  # up to the end of what is there
    assert Drafter([5, 6, 7, 8], min_ngram=2).propose(4) == []  # nothing repeats
    assert Drafter([5, 6, 5, 6], min_ngram=2).propose(4) == [5, 6]  # overlapping occurrences count
    assert Drafter([1, 2, 9, 2], min_ngram=1).propose(2) == [9, 2]  # a 1-gram where allowed
    assert Drafter([1, 2, 9, 2], min_ngram=2).propose(2) == []


def test_of_many_occurrences_the_one_matching_furthest_back_is_drafted_from():
    copied = [40, 41, 42, 7, 8, 50, 51, 52]  # the function being copied: its "7 8" goes on with 50
    other = [60, 61, 7, 8, 70, 71, 72]  # a later module with the same "7 8"
    d = Drafter([*copied, *other, 99, 40, 41, 42, 7, 8], max_ngram=2, min_ngram=2)
    assert d.propose(3) == [50, 51, 52]  # not 70 71 72, the latest "7 8"
    tie = Drafter([1, 7, 8, 2, 3, 7, 8, 4, 5, 6, 7, 8], max_ngram=2, min_ngram=2)
    assert tie.propose(2) == [4, 5]  # equal runs back: the latest


def test_a_long_context_is_searched_and_grown():
    context = list(range(5000)) * 2  # the second half repeats the first
    d = Drafter(context[:7000])
    assert d.propose(5) == [2000, 2001, 2002, 2003, 2004]
    d.extend(list(range(7000, 9000)))
    assert d.propose(3) == []  # 7000.. appear once


def test_k_doubles_after_a_full_accept_and_falls_after_a_miss():
    state = Lookup(k=8)
    state.adapt(8, 8)
    assert state.k == 16
    state.adapt(16, 16)
    assert state.k == K_MAX
    state.adapt(16, 3)
    assert state.k == 4
    state.adapt(4, 0)
    assert state.k == K_MIN


def test_misses_in_a_row_back_off_and_a_hit_ends_the_back_off():
    state = Lookup()
    state.adapt(8, 0)
    assert [state.ready() for _ in range(2)] == [False, True]  # one plain step, then a draft
    state.adapt(2, 0)
    assert [state.ready() for _ in range(3)] == [False, False, True]
    state.adapt(2, 0)
    state.adapt(2, 0)
    assert state.backoff == 8  # 1, 2, 4, 8 after four misses in a row
    state.wait = 0
    state.adapt(4, 2)
    assert state.backoff == 0 and state.ready()


def test_a_file_read_is_looked_up_without_its_numbers_and_as_a_json_string():
    read = "     1\tdef f(x):\n     2\t    return \"x\"\n"
    views = copy_views(["plain log line\n", read])
    assert views[0] == 'def f(x):\n    return "x"\n'  # newest first, numbers gone
    assert views[1] == 'def f(x):\\n    return \\"x\\"\\n'  # as old_string holds it
    assert views[2] == "plain log line\\n" and len(views) == 3  # no numbers: only its JSON form
    assert copy_views(["x" * 70000]) == []
