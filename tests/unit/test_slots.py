"""The slot table: which session each model slot holds (pure bookkeeping)."""

from __future__ import annotations

import pytest

from core.errors import EngineError
from core.kv.slot_table import SlotTable


def test_a_holder_keeps_its_slot_between_turns():
    table, a = SlotTable(2), object()
    first = table.seat(a)
    assert (first.slot, first.fresh, first.displaced) == (0, True, None)
    table.release(first.slot)
    again = table.seat(a)
    assert (again.slot, again.fresh, again.displaced) == (0, False, None)
    assert table.busy == 1 and table.resident == 1


def test_free_slots_go_first_then_the_least_recently_used_idle_one():
    table = SlotTable(2)
    a, b, c = object(), object(), object()
    sa, sb = table.seat(a), table.seat(b)
    assert {sa.slot, sb.slot} == {0, 1}
    table.release(sb.slot)
    table.release(sa.slot)  # a was released last: b is the least recently used
    sc = table.seat(c)
    assert sc.slot == sb.slot and sc.displaced is b and sc.fresh
    assert table.find(b) is None and table.find(c) == sb.slot


def test_busy_slots_are_never_given_away():
    table = SlotTable(2)
    a, b = object(), object()
    table.seat(a)
    table.seat(b)
    with pytest.raises(EngineError, match="all 2 slots are busy"):
        table.seat(object())
    with pytest.raises(EngineError, match="already busy"):
        table.seat(a)


def test_release_without_keep_and_evict_forget_the_holder():
    table = SlotTable(2)
    a, b = object(), object()
    table.release(table.seat(a).slot, keep=False)
    assert table.find(a) is None and table.resident == 0
    seat = table.seat(b)
    assert table.evict(b) is None  # busy: its turn is still running
    table.release(seat.slot)
    assert table.evict(b) == seat.slot and table.resident == 0


def test_a_recreated_session_is_a_new_holder():
    """Holders are compared by identity: a new object under the same name is not resident."""
    table = SlotTable(1)
    old = object()
    table.release(table.seat(old).slot)
    new = object()
    seat = table.seat(new)
    assert seat.fresh and seat.displaced is old
