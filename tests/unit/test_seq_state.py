"""core.llama.seq_cells: moving cells' position labels in a saved sequence state."""

import numpy as np
import pytest

from core.errors import EngineError
from core.llama.seq_cells import MAGIC, cell_positions, move_cells, restream


def blob(seq_id: int, positions: list[int], stream: int = 0, n_stream: int = 1) -> np.ndarray:
    """A state as llama_state_seq_get_data lays it out, with 8 bytes of K/V data per cell."""
    parts = [np.array([MAGIC, seq_id, n_stream], dtype="<u4").view(np.uint8)]
    for s in range(n_stream):
        if s != stream:
            parts.append(np.array([0], dtype="<u4").view(np.uint8))
            continue
        meta = np.array([[p, 1, seq_id] for p in positions], dtype="<i4").reshape(-1)
        data = np.arange(8 * len(positions), dtype=np.uint8)
        parts += [np.array([len(positions)], dtype="<u4").view(np.uint8), meta.view(np.uint8), data]
    return np.concatenate(parts)


def test_a_move_changes_the_labels_and_nothing_else():
    b = blob(2, [0, 1, 2, 7, 8], stream=2, n_stream=4)  # split streams: the sequence's own is the third
    before = b.copy()
    move_cells(b, 2, {2: 6})
    assert cell_positions(b, 2).tolist() == [0, 1, 6, 7, 8]
    changed = np.flatnonzero(b != before)
    assert changed.min() >= 12 + 4 * 3 and changed.max() < 12 + 4 * 3 + 12 * 5  # inside the cells' labels
    move_cells(b, 2, {6: 2})
    assert (b == before).all()


def test_moves_apply_at_once():
    b = blob(0, [0, 5, 9])
    move_cells(b, 0, {5: 8, 9: 5})  # 9 may take 5's place because 5 leaves it
    assert cell_positions(b, 0).tolist() == [0, 8, 5]


@pytest.mark.parametrize("moves, match", [({3: 4}, "no single KV cell"), ({0: 9}, "two at one position")])
def test_a_move_that_cannot_be_done_is_refused_untouched(moves, match):
    b = blob(0, [0, 1, 9])
    before = b.copy()
    with pytest.raises(EngineError, match=match):
        move_cells(b, 0, moves)
    assert (b == before).all()


def test_an_unknown_layout_is_refused():
    with pytest.raises(EngineError):
        move_cells(blob(1, [0, 1]), 0, {1: 2})  # another sequence's state
    wrong_magic = blob(0, [0, 1])
    wrong_magic[0] ^= 1
    with pytest.raises(EngineError):
        move_cells(wrong_magic, 0, {1: 2})
    two_ids = blob(0, [0, 1])
    two_ids[12 + 4 + 4] = 2  # the first cell claims two sequence ids (a shared cell's row is longer)
    with pytest.raises(EngineError):
        move_cells(two_ids, 0, {1: 2})
    with pytest.raises(EngineError):
        cell_positions(np.zeros(4, dtype=np.uint8), 0)
    assert cell_positions(blob(0, []), 0).size == 0  # an empty sequence has nothing to move


@pytest.mark.parametrize("positions", [[0, 1, 2, 7], []])
def test_a_state_moves_between_stream_layouts_unchanged(positions):
    split = blob(2, positions, stream=2, n_stream=4).tobytes()
    one = restream(split, 2, 1, 0)
    assert one == blob(2, positions).tobytes()
    assert restream(one, 2, 4, 2) == split
    assert restream(split, 2, 4, 2) == split
    assert cell_positions(np.frombuffer(restream(one, 2, 3, 0), dtype=np.uint8), 2).tolist() == positions


def test_a_state_that_is_not_one_sequence_is_not_restreamed():
    b = blob(1, [0, 1], stream=1, n_stream=3)
    b[-4] = 1  # a later stream claims a cell too
    with pytest.raises(EngineError, match="more than one stream"):
        restream(b.tobytes(), 1, 1, 0)
    with pytest.raises(EngineError, match="expected layout"):
        restream(blob(1, [0]).tobytes(), 0, 1, 0)  # another sequence's state


def test_a_kept_buffer_grows_unless_something_still_views_it():
    from core.llama.seq_cells import grow

    buf = bytearray(4)
    grow(buf, 16)
    assert len(buf) == 16
    grow(buf, 8)  # never shrinks
    assert len(buf) == 16
    view = memoryview(buf)
    with pytest.raises(EngineError, match="cannot grow"):
        grow(buf, 32)
    view.release()
    grow(buf, 32)
    assert len(buf) == 32
    grow(buf, 33)  # half as much again: a state that grows a little each turn grows the buffer rarely
    assert len(buf) == 48


def _cells(seq_id: int, positions: list[int], v_trans: bool, seed: int):
    from core.llama.seq_cells import Cells

    rng = np.random.default_rng(seed)
    n = len(positions)
    k = tuple(rng.integers(0, 255, (n, 8), dtype=np.uint8) for _ in range(2))
    v = tuple(rng.integers(0, 255, (4, n, 2) if v_trans else (n, 6), dtype=np.uint8) for _ in range(2))
    return Cells(seq_id, 3, 1, np.array(positions, np.int32), (1, 1), k, v_trans, (1, 1), v)


@pytest.mark.parametrize("v_trans", [False, True])
def test_parts_written_as_one_equal_their_join(v_trans):
    from core.llama.seq_cells import parse, write, write_joined_into

    a, b = _cells(1, [0, 1, 2], v_trans, 1), _cells(1, [7, 8], v_trans, 2)
    c = _cells(1, [9], v_trans, 3)
    buf = bytearray()
    joined = bytes(write_joined_into([a, b, c], buf))
    assert joined == write(a.join(b).join(c))
    back = parse(joined, 1)
    assert back.positions.tolist() == [0, 1, 2, 7, 8, 9]
    assert (back.at(7, 9).k[1] == b.k[1]).all() and len(back.at(3, 7)) == 0
    assert bytes(write_joined_into([a], buf)) == write(a)  # the same buffer, written again shorter


def test_owned_cells_no_longer_view_their_buffer():
    from core.llama.seq_cells import grow, parse, write

    buf = bytearray(write(_cells(1, [0, 1, 2, 3], False, 4)))
    part = parse(buf, 1).at(1, 3).owned()
    grow(buf, len(buf) + 10)  # nothing views it
    assert part.positions.tolist() == [1, 2] and part.of(0, 1, 0).stream == 0


def test_a_buffer_is_reserved_ahead_of_need_and_left_alone_while_it_has_room():
    from core.llama.seq_cells import reserve

    buf = bytearray()
    assert reserve(buf, 100) and len(buf) == 150
    assert not reserve(buf, 120)  # 150 >= 1.25 x 120: room enough
    assert reserve(buf, 121) and len(buf) == 225
