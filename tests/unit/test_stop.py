from core.decoding.stop import StopMatcher


def test_stop_string_split_across_pieces_is_held_back_and_cut():
    m = StopMatcher(("END",))
    assert m.feed("hello E") == "hello "
    assert m.feed("N") == ""
    assert m.feed("Dxyz") == ""
    assert m.stopped


def test_false_alarm_is_released():
    m = StopMatcher(("END",))
    assert m.feed("EN") == ""
    assert m.feed("o") == "ENo"
    assert not m.stopped
    assert m.feed("E") == ""
    assert m.flush() == "E"


def test_earliest_of_several_stops():
    m = StopMatcher(("b", "cd"))
    assert m.feed("acdb") == "a"
