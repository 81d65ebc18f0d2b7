"""A saved sequence's cells as arrays: taken apart, cut, joined and written back (pure numpy).

The blob is ``llama_state_seq_get_data``'s (llama.cpp as vendored by llama-cpp-python
0.3.36; core.llama.seq_state describes the header and cell rows).  After the cell rows
comes the data: ``u32 v_trans, u32 n_layer``; per layer ``i32 k_type, u64 k_row_bytes``
and the cells' K rows; then per layer ``i32 v_type, u64 v_row_bytes`` and V rows, or,
with V transposed (flash attention off), ``i32 v_type, u32 v_elem_bytes, u32 n_embd_v``
and for each V dimension its value in every cell.  One sequence, one stream, one sequence
id per cell; anything else raises :class:`EngineError` and the caller does without.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from core.errors import EngineError
from core.llama.seq_state import MAGIC

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


def parse(blob: bytes | memoryview, seq_id: int) -> Cells:
    r = _Reader(blob)
    if r.u32() != MAGIC or r.u32() != seq_id & 0xFFFFFFFF:
        raise EngineError("not a saved KV sequence of the expected layout")
    n_stream = r.u32()
    counts = []
    for _ in range(n_stream):
        counts.append(r.u32())
        if counts[-1]:
            break
    stream, count = len(counts) - 1, counts[-1]
    meta = r.take(12 * count).view("<i4").reshape(count, 3)
    if (meta[:, 1] != 1).any() or (meta[:, 2] != seq_id).any():
        raise EngineError("a saved KV sequence's cells are not laid out as expected")
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
