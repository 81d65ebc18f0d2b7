"""A llama.cpp context and its sequences (slots): decoding, batches of rows, KV edits,
views and state save/restore."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import llama_cpp
import numpy as np

from core.errors import EngineError, PromptTooLong, TurnCancelled
from core.llama import seq_cells
from core.llama.capture import AttentionCapture, QKCapture
from core.llama.model import Model

VIEW_SEQ = 1  # the view's sequence id in a one-slot context with views
_F = TypeVar("_F", bound=Callable[..., object])


def changes_cells(fn: _F) -> _F:
    """Marks a call that removes, moves, copies, relabels or loads KV cells.  Only
    ``core/kv/`` calls these: it keeps each session's bookkeeping in step with its cells
    (tests/unit/test_layering.py finds them by this mark).  ``decode`` is not one: it only
    appends cells after a sequence's last, where llama.cpp requires them."""
    return fn


KV_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}  # core.config.KV_CACHE_TYPES


class Context:
    """One llama.cpp context: ``n_seq`` sequences (slots), each up to ``n_ctx`` tokens.

    The engine works on one sequence through a :class:`Seq` handle (``ctx.seq(i)``);
    a step loop batches several sequences' tokens with :meth:`decode_rows`.

    Layout: with ``unified=False`` llama.cpp gives every sequence its own KV stream
    (``kv_unified=false``), so a sequence's attention reads only its own cells; a
    unified cache shares one pool of ``n_seq * n_ctx`` cells, and every token's
    attention spans all cells in use.

    With ``views=True`` (unified only) one more sequence id, ``view_seq``, serves as a
    per-step *view* of a slot: ``make_view`` tags the selected cells with it as well
    (``seq_cp``, no data is copied), a batch decoded through the view attends only to
    it, ``commit_view`` adds chosen new cells to the slot, and ``drop_view`` removes the
    tag, freeing the cells only the view held.  A slot never loses a cell to its view.

    A unified cache of several slots has one more sequence id, ``scratch_seq``: cells
    are tagged with it to be saved or rewritten apart from the slots that share them
    (:meth:`share_cells`), on the model thread between two decodes, and untagged after.
    """

    def __init__(self, model: Model, *, n_ctx: int, n_batch: int, n_ubatch: int, n_threads: int,
                 flash_attn: bool, capture: AttentionCapture | None = None, views: bool = False,
                 probe: QKCapture | None = None, n_seq: int = 1, unified: bool | None = None,
                 kv_type: str = "f16") -> None:
        self.model = model
        unified = (views or n_seq == 1) if unified is None else unified
        if views and not unified:
            raise EngineError("sequence views need a unified KV cache")
        params = llama_cpp.llama_context_default_params()
        scratch = unified and n_seq > 1
        params.n_seq_max = n_seq + (1 if views else 0) + (1 if scratch else 0)
        params.n_ctx = n_ctx * n_seq if unified else n_ctx * params.n_seq_max
        params.n_batch = n_batch
        params.n_ubatch = n_ubatch
        params.kv_unified = unified
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.no_perf = True
        params.type_k = KV_TYPES[kv_type]
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self.capture, self.probe = capture, probe
        if capture is not None:  # the capture decides: kq_soft_max exists only with flash attention off
            params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if capture.flash_attn
                                      else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            params.cb_eval = capture.callback
            params.cb_eval_user_data = None
        elif probe is not None:
            params.cb_eval = probe.callback
            params.cb_eval_user_data = None
        self.flash_attn = params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        # llama.cpp quantizes V only with flash attention; without it V stays f16 (a K-only
        # q8_0 context is what the flash capture's q8_0 rows are tested against)
        params.type_v = params.type_k if self.flash_attn else llama_cpp.GGML_TYPE_F16
        self.kv_type = kv_type
        self._ptr = llama_cpp.llama_init_from_model(model._ptr, params)
        if not self._ptr:
            raise EngineError(f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq={n_seq})")
        # per sequence: a unified pool lets one sequence grow to the whole pool, but a slot is
        # promised n_ctx; split streams are padded by llama.cpp to a multiple of 256
        self.n_ctx = n_ctx if unified else int(llama_cpp.llama_n_ctx_seq(self._ptr))
        self.n_seq, self.unified = n_seq, unified
        self.view_seq = n_seq if views else -1
        self.scratch_seq = params.n_seq_max - 1 if scratch else -1
        self.n_batch = n_batch
        self._mem = llama_cpp.llama_get_memory(self._ptr)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 2)
        self.abort: Callable[[], bool] | None = None  # checked between batches: a cancelled turn stops there
        self.move_buffer = bytearray()  # a sequence's saved state while its labels move (Seq.move), kept

    @property
    def n_stream(self) -> int:
        """KV streams: one pool, or one per sequence (what a saved state must match)."""
        return 1 if self.unified else self.n_seq

    @property
    def movable_labels(self) -> bool:
        """Whether a cell's position label can be moved without its K rotated (:meth:`Seq.move_labels`):
        through the sequence's saved state where cells are private, or, where slots share
        cells, through the scratch sequence (the moved cells alone)."""
        return self.private_cells or self.scratch_seq >= 0

    @property
    def private_cells(self) -> bool:
        """No cell is ever held by two sequences: split streams, or one sequence (whose
        view tags cells only while a speculative step runs, never during prefill)."""
        return not self.unified or self.n_seq == 1

    def close(self) -> None:
        if self._ptr:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ptr)
            self._ptr = None

    def seq(self, i: int = 0) -> Seq:
        if not 0 <= i < self.n_seq:
            raise EngineError(f"sequence {i} out of range: this context holds {self.n_seq}")
        return Seq(self, i)

    # -- memory -------------------------------------------------------------
    @changes_cells
    def clear_cells(self) -> None:
        """Empty every sequence."""
        llama_cpp.llama_memory_clear(self._mem, True)

    def seq_pos_max(self, seq_id: int) -> int:
        """The last position any cell of ``seq_id`` holds (-1: none); also for the view."""
        return int(llama_cpp.llama_memory_seq_pos_max(self._mem, seq_id))

    @changes_cells
    def share_cells(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Tag ``src``'s cells at positions [p0, p1) with ``dst`` too (unified only: no data
        moves, the cells are shared; ``dst`` keeps what it held)."""
        if not self.unified:
            raise EngineError("cells are shared between sequences only in a unified KV cache")
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def scratch(self) -> Seq:
        """The scratch sequence (empty between uses; see the class notes)."""
        if self.scratch_seq < 0:
            raise EngineError("this context has no scratch sequence (a unified cache of several slots has)")
        return Seq(self, self.scratch_seq)

    @changes_cells
    def copy_seq(self, src: int, dst: int) -> None:
        """Make ``dst`` hold exactly ``src``'s cells, now.  In a unified cache they are shared
        (no data moves).  Between split streams llama.cpp's ``seq_cp`` only queues a copy of
        the whole stream, done at the context's next decode: a state loaded into ``src``
        before then (another key's parked session taking the slot) would land in ``dst``
        instead, and a save of ``dst`` would read what it held before.  So the cells travel
        through ``src``'s saved state, relaid for ``dst``'s stream in the context's kept
        buffer (:attr:`move_buffer`): done when this returns."""
        llama_cpp.llama_memory_seq_rm(self._mem, dst, -1, -1)
        if self.unified:
            llama_cpp.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
            return
        state = Seq(self, src).save_to(self.move_buffer)
        Seq(self, dst).load_buffer(seq_cells.restream_in_place(state, dst))

    # -- decoding -----------------------------------------------------------
    def decode(self, tokens: Sequence[int], start_pos: int, logits_last: bool = True,
               logits_all: bool = False, seqs: tuple[int, ...] = (0,),
               abort: Callable[[], bool] | None = None) -> None:
        """Decode ``tokens`` at positions start_pos.. in batches of n_batch.

        ``logits_all`` keeps every token's logits (one batch at most, read with
        :meth:`logits_at`).  Every id in ``seqs`` holds the new cells (llama.cpp then
        masks attention by the lowest id, not the first).  ``abort`` (else the context's) is polled between
        batches."""
        n = len(tokens)
        if start_pos + n > self.n_ctx:
            raise PromptTooLong(start_pos + n, self.n_ctx, "sequence")
        if logits_all and n > self.n_batch:
            raise EngineError(f"logits for {n} tokens exceed one batch of {self.n_batch}")
        abort = abort or self.abort
        batch = self._batch
        for off in range(0, n, self.n_batch):
            if abort is not None and abort():
                raise TurnCancelled("the turn was cancelled during prefill")
            part = tokens[off: off + self.n_batch]
            batch.n_tokens = len(part)
            for i, tok in enumerate(part):
                batch.token[i] = tok
                batch.pos[i] = start_pos + off + i
                batch.n_seq_id[i] = len(seqs)
                for k, seq in enumerate(seqs):  # the first id picks the cells attended (the view)
                    batch.seq_id[i][k] = seq
                batch.logits[i] = logits_all
            last = off + len(part) == n
            if last and logits_last:
                batch.logits[len(part) - 1] = 1
            self._run(batch, start_pos + off)

    def decode_rows(self, rows: Sequence[tuple[int, Sequence[int], int, bool]]) -> list[int]:
        """One batch of several sequences' tokens: rows of (seq, tokens, start_pos, logits of
        the last).  Returns each row's last batch index, for :meth:`logits_at` or sampling.
        Rows go in ascending sequence order: llama.cpp puts consecutive sequence ids of
        split streams into one ubatch."""
        batch, i, last = self._batch, 0, []
        for seq, tokens, start_pos, want in rows:
            if start_pos + len(tokens) > self.n_ctx:
                raise PromptTooLong(start_pos + len(tokens), self.n_ctx, "sequence")
            for k, tok in enumerate(tokens):
                if i >= self.n_batch:
                    raise EngineError(f"a step of more than {self.n_batch} tokens")
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, start_pos + k, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = want and k == len(tokens) - 1
                i += 1
            last.append(i - 1)
        batch.n_tokens = i
        self._run(batch, rows[0][2] if rows else 0)
        return last

    def _run(self, batch: llama_cpp.llama_batch, pos: int) -> None:
        rc = llama_cpp.llama_decode(self._ptr, batch)
        if rc != 0:
            raise EngineError(f"llama_decode returned {rc} at positions {pos}..")

    def logits(self) -> np.ndarray:
        """Logits of the last token that requested them (a copy)."""
        return self.logits_at(-1)

    def logits_at(self, i: int) -> np.ndarray:
        """Logits of the i-th token of the last batch (a copy)."""
        return self.logits_view(i).copy()

    def logits_view(self, i: int) -> np.ndarray:
        """Logits of the i-th token of the last batch, in place: what a grammar masks before
        the sampler reads them.  Valid until the next decode."""
        ptr = llama_cpp.llama_get_logits_ith(self._ptr, i)
        if not ptr:
            raise EngineError(f"no logits for batch index {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))

    @property
    def ptr(self) -> llama_cpp.llama_context_p:
        return self._ptr


class Seq:
    """One sequence (slot) of a :class:`Context`: every call the engine makes for one
    session's KV.  A handle only; the context owns the memory."""

    __slots__ = ("ctx", "id")

    def __init__(self, ctx: Context, seq_id: int) -> None:
        self.ctx, self.id = ctx, seq_id

    @property
    def model(self) -> Model:
        return self.ctx.model

    @property
    def n_ctx(self) -> int:
        return self.ctx.n_ctx

    @property
    def ptr(self) -> llama_cpp.llama_context_p:
        return self.ctx.ptr

    @property
    def _mem(self) -> llama_cpp.llama_memory_t:
        return self.ctx._mem

    def decode(self, tokens: Sequence[int], start_pos: int, logits_last: bool = True,
               logits_all: bool = False, through_view: bool = False) -> None:
        seqs = (self.ctx.view_seq,) if through_view else (self.id,)
        self.ctx.decode(tokens, start_pos, logits_last, logits_all, seqs)

    def logits(self) -> np.ndarray:
        return self.ctx.logits()

    def logits_at(self, i: int) -> np.ndarray:
        return self.ctx.logits_at(i)

    def pos_max(self) -> int:
        return self.ctx.seq_pos_max(self.id)

    @changes_cells
    def clear_cells(self) -> None:
        llama_cpp.llama_memory_seq_rm(self._mem, self.id, -1, -1)

    @changes_cells
    def remove_from(self, pos: int) -> None:
        if not llama_cpp.llama_memory_seq_rm(self._mem, self.id, pos, -1):
            raise EngineError(f"could not remove KV cells from position {pos}")

    @changes_cells
    def remove_cells(self, p0: int, p1: int) -> None:
        """Drop the cells at positions [p0, p1)."""
        llama_cpp.llama_memory_seq_rm(self._mem, self.id, p0, p1)

    @changes_cells
    def shift_cells(self, p0: int, p1: int, delta: int) -> None:
        llama_cpp.llama_memory_seq_add(self._mem, self.id, p0, p1, delta)

    @changes_cells
    def move_labels(self, moves: Mapping[int, int]) -> None:
        """Relabel the cells at positions ``moves`` keys with the values, leaving their K as
        it is (core.llama.seq_cells): a sparse prefill's bridge without a K-shift of the
        whole context.  Where cells are private this copies the sequence's cells out and
        back.  Where slots share cells only the moved cells go, through the scratch
        sequence (tagged there, untagged here, relabelled there as new cells, tagged here
        again), so a slot that shares one keeps it where it was."""
        if self.ctx.private_cells:
            self._relabel(self.id, moves)
            return
        ctx, via = self.ctx, self.ctx.scratch()
        via.clear_cells()
        try:
            for p in moves:
                ctx.share_cells(self.id, via.id, p, p + 1)
                llama_cpp.llama_memory_seq_rm(self._mem, self.id, p, p + 1)
            try:
                self._relabel(via.id, moves)
            except EngineError:
                self.clear_cells()  # its moved cells are gone: the caller rebuilds
                raise
            for q in moves.values():
                ctx.share_cells(via.id, self.id, q, q + 1)
        finally:
            via.clear_cells()

    def _relabel(self, seq_id: int, moves: Mapping[int, int]) -> None:
        """Move labels in sequence ``seq_id``'s saved state and load it back (emptied on failure),
        through the context's kept buffer: a sparse prefill's bridges each copy the whole
        sequence where cells are private, and fresh pages for it cost more than the copy."""
        seq = Seq(self.ctx, seq_id)
        state = seq.save_to(self.ctx.move_buffer)
        seq_cells.move_cells(np.frombuffer(state, dtype=np.uint8), seq_id, moves)
        seq.load_buffer(state)

    @changes_cells
    def make_view(self, spans: Sequence[tuple[int, int]]) -> None:
        """Tag the cells at positions [p0, p1) of each span with the view sequence.
        A batch decoded through the view must start right after its last cell."""
        if self.ctx.view_seq < 0:
            raise EngineError("this context has no view sequence (SpecAttn needs a unified cache)")
        self.drop_view()
        for p0, p1 in spans:
            llama_cpp.llama_memory_seq_cp(self._mem, self.id, self.ctx.view_seq, p0, p1)

    @changes_cells
    def commit_view(self, p0: int, p1: int) -> None:
        """Make the view's cells at positions [p0, p1) part of this sequence too."""
        llama_cpp.llama_memory_seq_cp(self._mem, self.ctx.view_seq, self.id, p0, p1)

    @changes_cells
    def drop_view(self) -> None:
        llama_cpp.llama_memory_seq_rm(self._mem, self.ctx.view_seq, -1, -1)

    def view(self) -> Seq:
        """The view as a sequence handle: a batch decoded into it attends to the view's
        cells alone, and its new cells belong to the view until :meth:`commit_view`."""
        if self.ctx.view_seq < 0:
            raise EngineError("this context has no view sequence")
        return Seq(self.ctx, self.ctx.view_seq)

    @property
    def stream(self) -> int:
        """The KV stream holding this sequence's cells (each its own in a split context)."""
        return 0 if self.ctx.unified else self.id

    @changes_cells
    def load_from(self, other: Seq) -> None:
        """Replace this sequence's cells with ``other``'s, which may be in another context
        of the same model and cache types: a copy through the saved state, laid out for
        this context's streams (core.llama.seq_cells.restream)."""
        self.load_state(seq_cells.restream(other.save(), other.id, self.ctx.n_stream, self.stream))

    def state_size(self) -> int:
        """The bytes :meth:`save` would write."""
        return int(llama_cpp.llama_state_seq_get_size(self.ptr, self.id))

    def save(self) -> bytes:
        """Serialize this sequence's KV cells (llama_state_seq_get_data)."""
        return bytes(self.save_to(bytearray()))

    def save_to(self, buf: bytearray) -> memoryview:
        """:meth:`save` into ``buf`` (grown when short), which a caller keeps between saves:
        fresh pages for a large state cost more than copying it on this kind of VM."""
        size = llama_cpp.llama_state_seq_get_size(self.ptr, self.id)
        seq_cells.grow(buf, size)
        n = llama_cpp.llama_state_seq_get_data(self.ptr, (ctypes.c_uint8 * size).from_buffer(buf), size, self.id)
        return memoryview(buf)[:n]

    @changes_cells
    def load_buffer(self, blob: memoryview) -> None:
        """:meth:`load_state` from a writable buffer (:func:`core.llama.seq_cells.write_into`), not copied."""
        self.clear_cells()
        if llama_cpp.llama_state_seq_set_data(self.ptr, (ctypes.c_uint8 * len(blob)).from_buffer(blob), len(blob),
                                              self.id) == 0:
            self.clear_cells()
            raise EngineError("could not restore a saved KV sequence")

    @changes_cells
    def load_state(self, blob: bytes) -> None:
        """Replace this sequence's cells with ones saved by :meth:`save` (b"": empty it)."""
        if blob:
            self.load_buffer(memoryview(bytearray(blob)))
        else:
            self.clear_cells()
