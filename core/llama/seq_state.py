"""Moving KV cells to other positions in a sequence's saved state (pure numpy, no llama.cpp).

An original-position sparse prefill must satisfy llama.cpp's batch check: a batch for a
sequence starts right after the sequence's last cell.  Moving that cell with
``llama_memory_seq_add`` makes llama.cpp re-rotate the K of *every* cell of the context
(its K-shift graph spans the whole cache: 1.0-1.2 s for the 1.5B target's 4 x 8K cells on
the 2-core VM), although the bridge needs only the cell's position label.  Edited in the
sequence's state blob (``llama_state_seq_get_data``) and loaded back, the cell keeps its K
as decoded at its own position, so attention is exact, and the cost is two copies of the
sequence's cells.

The blob (``llama_context::state_seq_get_data``, llama.cpp as vendored by
llama-cpp-python 0.3.36): ``u32 magic, i32 seq_id, u32 n_stream``, then per stream
``u32 cell_count`` and, when it is not zero, ``cell_count`` rows of ``i32 pos, u32 n_seq_id,
i32 seq_id`` followed by the stream's K/V data.  A single sequence lives in one stream.
Anything else raises :class:`EngineError`, and the caller keeps the K-shift.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

import numpy as np

from core.errors import EngineError

MAGIC = 0xAF143CD8
HEADER = 12  # magic, seq_id, n_stream


def cell_positions(blob: np.ndarray, seq_id: int) -> np.ndarray:
    """A writable view of the position of every cell in ``blob`` (a uint8 array of one
    sequence's saved state), in cell order."""
    if len(blob) < HEADER:
        raise EngineError("not a saved KV sequence of the expected layout")
    words = blob[:HEADER].view("<u4")
    if int(words[0]) != MAGIC or int(words[1]) != seq_id:
        raise EngineError("not a saved KV sequence of the expected layout")
    offset = HEADER
    for _ in range(int(words[2])):
        count = int(blob[offset:offset + 4].view("<u4")[0])
        offset += 4
        if count:
            meta = blob[offset:offset + 12 * count].view("<i4").reshape(count, 3)
            if len(meta) != count or (meta[:, 1] != 1).any() or (meta[:, 2] != seq_id).any():
                raise EngineError("a saved KV sequence's cells are not laid out as expected")
            return meta[:, 0]
    return np.zeros(0, dtype="<i4")


def move_cells(blob: np.ndarray, seq_id: int, moves: Mapping[int, int]) -> None:
    """Give the cell at position ``p`` position ``moves[p]``, for each key, in place.
    Every key must name one cell and no two cells may end up at one position."""
    pos = cell_positions(blob, seq_id)
    new = pos.copy()
    for src, dst in moves.items():
        at = np.flatnonzero(pos == src)
        if at.size != 1:
            raise EngineError(f"no single KV cell at position {src} to move")
        new[at[0]] = dst
    if np.unique(new).size != new.size:
        raise EngineError("moving KV cells would put two at one position")
    pos[:] = new


def restream(blob: bytes, seq_id: int, n_stream: int, stream: int) -> bytes:
    """The same saved sequence laid out for a context with ``n_stream`` KV streams, its
    cells in stream ``stream``: llama.cpp refuses a state whose stream count differs
    from the context's, though a sequence's cells and data are the same in each (a split
    context writes one count per stream, a zero word for each but the sequence's own)."""
    zero = b"\0\0\0\0"
    words = np.frombuffer(blob[:HEADER], dtype="<u4")
    if len(words) < 3 or int(words[0]) != MAGIC or int(words[1]) != seq_id or not 0 <= stream < n_stream:
        raise EngineError("not a saved KV sequence of the expected layout")
    streams = int(words[2])
    own = 0  # the sequence's stream: the first whose count is not zero (all zero: an empty sequence)
    while own < streams - 1 and blob[HEADER + 4 * own: HEADER + 4 * own + 4] == zero:
        own += 1
    after = 4 * (streams - 1 - own)
    body = blob[HEADER + 4 * own: len(blob) - after]
    if len(body) < 4 or blob[len(blob) - after:] != zero * (streams - 1 - own):
        raise EngineError("a saved KV sequence spans more than one stream")
    head = np.array([MAGIC, seq_id & 0xFFFFFFFF, n_stream], dtype="<u4").tobytes()
    return head + zero * stream + body + zero * (n_stream - 1 - stream)


def restream_in_place(state: memoryview, stream: int) -> memoryview:
    """:func:`restream` for a context's own stream count, in the buffer ``state`` views (a
    sequence's saved state, written by ``Seq.save_to`` into a buffer kept for it): the
    sequence's count and cells slide to ``stream``'s place, the other counts are zeroed, and
    nothing is allocated (a prefix's state is hundreds of MB, and fresh pages cost more than
    the copy).  Returns ``state``."""
    buf = np.frombuffer(state, dtype=np.uint8)
    if len(buf) < HEADER or int(buf[:4].view("<u4")[0]) != MAGIC:
        raise EngineError("not a saved KV sequence of the expected layout")
    n_stream = int(buf[8:12].view("<u4")[0])
    counts = buf[HEADER:HEADER + 4 * n_stream].view("<u4") if len(buf) >= HEADER + 4 * n_stream else None
    if counts is None or not 0 <= stream < n_stream:
        raise EngineError("not a saved KV sequence of the expected layout")
    own = int(np.argmax(counts != 0)) if counts.any() else stream
    block = len(buf) - HEADER - 4 * (n_stream - 1)  # the count and the cells
    src, dst = HEADER + 4 * own, HEADER + 4 * stream
    if src != dst:
        ctypes.memmove(buf.ctypes.data + dst, buf.ctypes.data + src, block)
        buf[HEADER:dst] = 0
        buf[dst + block:] = 0
    return state
