"""A sequence's saved state (``llama_state_seq_get_data``), parsed in this one module (pure numpy).

The blob (``llama_context::state_seq_get_data``, llama.cpp as vendored by llama-cpp-python
0.3.36): ``u32 magic, i32 seq_id, u32 n_stream``, then per stream ``u32 cell_count`` and,
when it is not zero, ``cell_count`` rows of ``i32 pos, u32 n_seq_id, i32 seq_id`` followed
by the stream's K/V data: ``u32 v_trans, u32 n_layer``; per layer ``i32 k_type, u64
k_row_bytes`` and the cells' K rows; then per layer ``i32 v_type, u64 v_row_bytes`` and V
rows, or, with V transposed (flash attention off), ``i32 v_type, u32 v_elem_bytes, u32
n_embd_v`` and for each V dimension its value in every cell.  One sequence, one stream,
one sequence id per cell; anything else raises :class:`EngineError` and the caller does
without.

Two kinds of use:

- **cells as arrays** (:func:`parse`, :class:`Cells`, :func:`write_joined_into`): taken
  apart, cut, joined and written back -- splices, the scoring window, stream copies;
- **edits in place** (:func:`cell_positions`, :func:`move_cells`, :func:`restream`,
  :func:`restream_in_place`): an original-position sparse prefill must satisfy llama.cpp's
  batch check (a batch for a sequence starts right after its last cell).  Moving that cell
  with ``llama_memory_seq_add`` makes llama.cpp re-rotate the K of *every* cell of the
  context (1.0-1.2 s for the 1.5B target's 4 x 8K cells on the 2-core VM), although the
  bridge needs only the cell's position label.  Edited in the blob and loaded back, the
  cell keeps its K as decoded at its own position, so attention is exact, and the cost is
  two copies of the sequence's cells.
"""


from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from core.errors import EngineError

MAGIC = 0xAF143CD8
HEADER = 12  # magic, seq_id, n_stream
F32, F16 = 0, 1  # ggml types whose K rows core.kv.rope can rotate


@dataclass(slots=True, frozen=True)
class Cells:
    seq_id: int
    n_stream: int
    stream: int  # whose count is not zero
    positions: np.ndarray  # int32, one per cell, in cell order
    k_types: tuple[int, ...]
    k: tuple[np.ndarray, ...]  # per layer: uint8 (cells, row bytes)
    v_trans: bool
    v_types: tuple[int, ...]
    v: tuple[np.ndarray, ...]  # per layer: uint8 (cells, row bytes), or transposed (n_embd, cells, elem bytes)

    def __len__(self) -> int:
        return len(self.positions)

    def take(self, index: np.ndarray) -> Cells:
        """The cells at ``index`` (cell order), in that order: views where ``index`` is one
        ascending run of cells (a run saved apart), copies otherwise."""
        at: np.ndarray | slice = index
        if index.size and np.array_equal(index, np.arange(index[0], index[0] + index.size)):
            at = slice(int(index[0]), int(index[0]) + index.size)
        return replace(self, positions=self.positions[at], k=tuple(k[at] for k in self.k),
                       v=tuple(v[:, at] if self.v_trans else v[at] for v in self.v))

    def at(self, lo: int, hi: int) -> Cells:
        """The cells at positions [lo, hi), in position order."""
        index = np.flatnonzero((self.positions >= lo) & (self.positions < hi))
        return self.take(index[np.argsort(self.positions[index], kind="stable")])

    def owned(self) -> Cells:
        """These cells as copies, so the buffer they were parsed from can be written again."""
        return replace(self, positions=self.positions.copy(), k=tuple(x.copy() for x in self.k),
                       v=tuple(x.copy() for x in self.v))

    def of(self, seq_id: int, n_stream: int, stream: int) -> Cells:
        """The same cells as sequence ``seq_id`` of a context with ``n_stream`` streams."""
        return replace(self, seq_id=seq_id, n_stream=n_stream, stream=stream)

    def join(self, other: Cells) -> Cells:
        """These cells, then ``other``'s (same model and cache types)."""
        if (self.k_types, self.v_types, self.v_trans) != (other.k_types, other.v_types, other.v_trans):
            raise EngineError("saved KV cells of different cache types cannot be joined")
        axis = 1 if self.v_trans else 0
        return replace(self, positions=np.concatenate([self.positions, other.positions]),
                       k=tuple(np.concatenate(p) for p in zip(self.k, other.k, strict=True)),
                       v=tuple(np.concatenate(p, axis=axis) for p in zip(self.v, other.v, strict=True)))


class _Reader:
    def __init__(self, blob: bytes | memoryview) -> None:
        self.buf, self.at = np.frombuffer(blob, dtype=np.uint8), 0

    def take(self, n: int) -> np.ndarray:
        if self.at + n > len(self.buf):
            raise EngineError("a saved KV sequence ends early")
        out = self.buf[self.at:self.at + n]
        self.at += n
        return out

    def u32(self) -> int:
        return int(self.take(4).view("<u4")[0])

    def u64(self) -> int:
        return int(self.take(8).view("<u8")[0])


def _header(buf: np.ndarray, seq_id: int) -> tuple[int, int, int, int]:
    """(streams, the sequence's stream, its cell count, where its cell rows start): the
    first stream whose count is not zero (all zero: an empty sequence, in the last)."""
    if len(buf) < HEADER:
        raise EngineError("not a saved KV sequence of the expected layout")
    words = buf[:HEADER].view("<u4")
    if int(words[0]) != MAGIC or int(words[1]) != seq_id & 0xFFFFFFFF:
        raise EngineError("not a saved KV sequence of the expected layout")
    n_stream, offset = int(words[2]), HEADER
    for stream in range(n_stream):
        if offset + 4 > len(buf):
            raise EngineError("a saved KV sequence ends early")
        count = int(buf[offset:offset + 4].view("<u4")[0])
        offset += 4
        if count:
            return n_stream, stream, count, offset
    return n_stream, n_stream - 1, 0, offset


def _cell_rows(buf: np.ndarray, seq_id: int, count: int, offset: int) -> np.ndarray:
    meta = buf[offset:offset + 12 * count].view("<i4").reshape(-1, 3)
    if len(meta) != count or (meta[:, 1] != 1).any() or (meta[:, 2] != seq_id).any():
        raise EngineError("a saved KV sequence's cells are not laid out as expected")
    return meta


def parse(blob: bytes | memoryview, seq_id: int) -> Cells:
    r = _Reader(blob)
    n_stream, stream, count, r.at = _header(r.buf, seq_id)
    meta = _cell_rows(r.take(12 * count), seq_id, count, 0)
    v_trans, n_layer = r.u32(), r.u32()
    k_types, k = list[int](), list[np.ndarray]()
    for _ in range(n_layer):
        k_types.append(r.u32())
        row = r.u64()
        k.append(r.take(count * row).reshape(count, row))
    v_types, v = list[int](), list[np.ndarray]()
    for _ in range(n_layer):
        v_types.append(r.u32())
        if v_trans:
            elem, n_embd = r.u32(), r.u32()
            v.append(r.take(n_embd * count * elem).reshape(n_embd, count, elem))
        else:
            row = r.u64()
            v.append(r.take(count * row).reshape(count, row))
    if any(r.u32() for _ in range(n_stream - 1 - stream)) or r.at != len(r.buf):
        raise EngineError("a saved KV sequence spans more than one stream")
    return Cells(seq_id, n_stream, stream, meta[:, 0].copy(), tuple(k_types), tuple(k), bool(v_trans),
                 tuple(v_types), tuple(v))


def write(cells: Cells) -> bytes:
    return bytes(write_into(cells, bytearray()))


def write_into(cells: Cells, buf: bytearray) -> memoryview:
    """:func:`write` into ``buf`` (grown when short): a buffer kept between calls is written
    without fresh pages, which cost more than the copy on this kind of VM."""
    return write_joined_into([cells], buf)


def write_joined_into(parts: Sequence[Cells], buf: bytearray) -> memoryview:
    """The cells of ``parts`` one after another, as the first part's sequence, written into
    ``buf`` as :func:`write_into` does, without joining them in memory first."""
    first = parts[0]
    if any((p.k_types, p.v_types, p.v_trans) != (first.k_types, first.v_types, first.v_trans) for p in parts):
        raise EngineError("saved KV cells of different cache types cannot be joined")
    heads = _pieces(replace(first, positions=np.concatenate([p.positions for p in parts]), k=(), v=()))
    n_cells = sum(len(p) for p in parts)
    layer_bytes = sum(x.nbytes for p in parts for x in (*p.k, *p.v))
    heads_bytes = 24 * len(first.k_types)  # each layer's K and V heads: a type and a size
    n = sum(x.nbytes for x in heads) + (heads_bytes + layer_bytes if n_cells else 0)
    grow(buf, n)
    out, at = np.frombuffer(buf, dtype=np.uint8, count=n), 0

    def put(x: np.ndarray) -> None:
        nonlocal at
        out[at:at + x.nbytes] = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
        at += x.nbytes

    for x in heads[:-1]:
        put(x)
    if n_cells:
        for i, t in enumerate(first.k_types):
            put(np.array([t], "<u4"))
            put(np.array([first.k[i].shape[1]], "<u8"))
            for p in parts:
                put(p.k[i])
        for i, t in enumerate(first.v_types):
            put(np.array([t], "<u4"))
            if first.v_trans:  # each V dimension's values over all the cells of every part
                put(np.array([first.v[i].shape[2], first.v[i].shape[0]], "<u4"))
                block = out[at:at + sum(p.v[i].nbytes for p in parts)].reshape(first.v[i].shape[0], n_cells, -1)
                col = 0
                for p in parts:
                    block[:, col:col + len(p)] = p.v[i].reshape(p.v[i].shape[0], len(p), -1)
                    col += len(p)
                at += block.nbytes
            else:
                put(np.array([first.v[i].shape[1]], "<u8"))
                for p in parts:
                    put(p.v[i])
    put(heads[-1])
    return memoryview(buf)[:n]


def grow(buf: bytearray, n: int) -> None:
    """Make ``buf`` hold at least ``n`` bytes, and half as much again when it grows (a
    session's state grows every turn, and each growth pays fresh pages); EngineError while
    something still views it (a caller that failed mid-way and kept its arrays), so the
    caller does without."""
    if len(buf) < n:
        try:
            buf.extend(bytes(max(n, len(buf) * 3 // 2) - len(buf)))
        except BufferError as exc:
            raise EngineError(f"a KV buffer in use cannot grow: {exc}") from exc


def reserve(buf: bytearray, size: int) -> bool:
    """Grow ``buf`` ahead of need (idle time): to half again ``size`` when it holds less than a
    quarter more, so the copies a turn makes through it find their pages already there.
    Returns whether it grew."""
    if len(buf) >= size * 5 // 4:
        return False
    grow(buf, size * 3 // 2)
    return True


def _pieces(cells: Cells) -> list[np.ndarray]:
    """The blob's header and cell rows, then its trailing stream counts (the caller writes
    each layer's K and V between them)."""
    n = len(cells)
    out = [np.array([MAGIC, cells.seq_id & 0xFFFFFFFF, cells.n_stream], dtype="<u4"),
           np.zeros(cells.stream, dtype="<u4"), np.array([n], dtype="<u4")]
    if n:
        meta = np.stack([cells.positions, np.ones(n, np.int32), np.full(n, cells.seq_id, np.int32)], axis=1)
        out += [meta.astype("<i4"), np.array([cells.v_trans, len(cells.k_types)], dtype="<u4")]
    out.append(np.zeros(cells.n_stream - 1 - cells.stream, dtype="<u4"))
    return out


def k_rows(k: np.ndarray, k_type: int) -> np.ndarray:
    """A layer's K rows as floats (F32 or F16 caches only)."""
    if k_type not in (F32, F16):
        raise EngineError(f"cannot move K cells of ggml type {k_type} (f16 or f32 only)")
    return k.view("<f4" if k_type == F32 else "<f2")


def from_rows(rows: np.ndarray, k_type: int) -> np.ndarray:
    return np.ascontiguousarray(rows.astype("<f4" if k_type == F32 else "<f2")).view(np.uint8)


def cell_positions(blob: np.ndarray, seq_id: int) -> np.ndarray:
    """A writable view of the position of every cell in ``blob`` (a uint8 array of one
    sequence's saved state), in cell order."""
    _, _, count, offset = _header(blob, seq_id)
    return _cell_rows(blob, seq_id, count, offset)[:, 0] if count else np.zeros(0, dtype="<i4")


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
