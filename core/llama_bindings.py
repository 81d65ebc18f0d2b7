"""ctypes plumbing over llama-cpp-python's low-level API (and three ggml calls).

This module is the only place that touches llama.cpp pointers.  Objects here
are not thread-safe: the engine calls them from its model worker thread only.
"""

from __future__ import annotations

import ctypes
import functools
import re
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import llama_cpp
import numpy as np

from core.errors import EngineError, ModelFileError, PromptTooLong, TurnCancelled

_backend_lock = threading.Lock()
_backend_ready = False


@llama_cpp.llama_log_callback
def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if level == 4:  # GGML_LOG_LEVEL_ERROR: keep real errors on stderr
        sys.stderr.write(text.decode("utf-8", "replace"))


def init_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _backend_ready = True


@functools.cache
def _ggml() -> ctypes.CDLL:
    """libggml-base, loaded on first use (importing this module loads no native library
    beyond llama_cpp's own)."""
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return lib


# struct ggml_tensor { enum ggml_type type; ggml_backend_buffer * buffer; int64_t ne[4]; size_t nb[4]; ... }
_NE_OFFSET = ctypes.sizeof(ctypes.c_void_p) * 2
_SOFTMAX = re.compile(rb"^kq_soft_max-(\d+)$")
_QK = re.compile(rb"^(Qcur|Kcur)-(\d+)$")


def validate_gguf(path: str) -> Path:
    p = Path(path).expanduser()
    if not str(path):
        raise ModelFileError("no model file given")
    if not p.exists():
        raise ModelFileError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelFileError(f"model path is not a file: {p}")
    try:
        with p.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelFileError(f"model file unreadable: {p}: {exc.strerror}") from exc
    if magic != b"GGUF":
        raise ModelFileError(f"not a GGUF file (magic {magic!r}): {p}")
    return p


class Model:
    """A loaded GGUF model: tokenizer, metadata, and a factory for contexts."""

    def __init__(self, path: str) -> None:
        self.path = validate_gguf(path)
        init_backend()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        self._ptr = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._ptr:
            raise ModelFileError(f"llama.cpp could not load {self.path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self._ptr)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_layer = llama_cpp.llama_model_n_layer(self._ptr)
        self.n_head = llama_cpp.llama_model_n_head(self._ptr)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self._ptr)
        self.size_bytes = self.path.stat().st_size
        head_dim = llama_cpp.llama_model_n_embd(self._ptr) // max(1, self.n_head)
        # f16 K and V of every layer: what one cached token costs a context
        self.kv_bytes_per_token = 2 * 2 * self.n_layer * llama_cpp.llama_model_n_head_kv(self._ptr) * head_dim

    def close(self) -> None:
        if self._ptr:
            llama_cpp.llama_model_free(self._ptr)
            self._ptr = None

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        arr = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), arr, cap, add_special, parse_special)
        if n < 0:
            arr = (llama_cpp.llama_token * -n)()
            n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), arr, -n, add_special, parse_special)
        return list(arr[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int] | tuple[int, ...], special: bool = False) -> str:
        return b"".join(self.token_bytes(t, special) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))


class AttentionCapture:
    """cb_eval hook that copies the last query row of every ``kq_soft_max-*`` tensor.

    Only the wanted row is read, per head, with ``ggml_backend_tensor_get`` at
    the row's byte offset: the N x N matrix is never copied.
    """

    def __init__(self, n_layer: int) -> None:
        self.n_layer = n_layer
        self.active = False
        self.n_keys = 0
        self._rows: dict[int, np.ndarray] = {}
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)

    def start(self, n_keys: int) -> None:
        self.n_keys = n_keys
        self._rows = {}
        self.active = True

    def stop(self) -> np.ndarray:
        """Rows of the step just decoded: [n_layer, n_head, n_keys]."""
        self.active = False
        if len(self._rows) != self.n_layer:
            raise EngineError(f"captured {len(self._rows)} of {self.n_layer} attention layers")
        return np.stack([self._rows[i] for i in range(self.n_layer)])

    def _on_eval(self, tensor: int, ask: bool, user_data: int) -> bool:
        if not self.active:
            return not ask
        name = _ggml().ggml_get_name(tensor)
        match = _SOFTMAX.match(name or b"")
        if ask:
            return match is not None
        if match is not None:
            self._copy_last_row(tensor, int(match.group(1)))
        return True

    def _copy_last_row(self, tensor: int, layer: int) -> None:
        dims = (ctypes.c_int64 * 4).from_address(tensor + _NE_OFFSET)
        strides = (ctypes.c_size_t * 4).from_address(tensor + _NE_OFFSET + 32)
        n_kv, n_q, n_head = dims[0], dims[1], dims[2]
        n_read = min(n_kv, self.n_keys)
        out = np.empty((n_head, n_read), dtype=np.float32)
        for h in range(n_head):
            offset = (n_q - 1) * strides[1] + h * strides[2]
            _ggml().ggml_backend_tensor_get(tensor, out[h].ctypes.data, offset, n_read * 4)
        self._rows[layer] = out


def _tensor_f32(tensor: int) -> np.ndarray | None:
    """A contiguous f32 tensor's data as [ne2, ne1, ne0]; None for anything else."""
    if ctypes.c_int.from_address(tensor).value != 0:  # GGML_TYPE_F32
        return None
    ne = (ctypes.c_int64 * 4).from_address(tensor + _NE_OFFSET)
    nb = (ctypes.c_size_t * 4).from_address(tensor + _NE_OFFSET + 32)
    if nb[0] != 4 or nb[1] != 4 * ne[0] or nb[2] != nb[1] * ne[1]:
        return None
    out = np.empty((ne[2], ne[1], ne[0]), dtype=np.float32)
    _ggml().ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
    return out


class QKCapture:
    """cb_eval hook for the target's post-RoPE keys (over a prefill) or the query of one
    decoded token, per layer (``Kcur-*``/``Qcur-*``; the last node of a name is the
    post-RoPE one).  Works with flash attention on.  Used by the Quest-style eval baseline."""

    def __init__(self, n_layer: int) -> None:
        self.n_layer = n_layer
        self.mode = ""
        self._keys: dict[int, list[np.ndarray]] = {}
        self._last: dict[int, np.ndarray] = {}
        self._query: dict[int, np.ndarray] = {}
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)

    def start_keys(self) -> None:
        self.mode, self._keys, self._last = "Kcur", {}, {}

    def stop_keys(self) -> np.ndarray:
        """[n_layer, n_kv_head, n_tokens, head_dim]."""
        self._flush_keys()
        self.mode = ""
        return np.stack([np.concatenate(self._keys[i], axis=0).transpose(1, 0, 2) for i in range(self.n_layer)])

    def start_query(self) -> None:
        self.mode, self._query = "Qcur", {}

    def stop_query(self) -> np.ndarray:
        """[n_layer, n_head, head_dim] of the single decoded token."""
        self.mode = ""
        return np.stack([self._query[i][-1] for i in range(self.n_layer)])

    def _flush_keys(self) -> None:
        for layer, k in self._last.items():  # one entry per ubatch: its last (post-RoPE) node
            self._keys.setdefault(layer, []).append(k)
        self._last = {}

    def _on_eval(self, tensor: int, ask: bool, user_data: int) -> bool:
        if not self.mode:
            return not ask
        match = _QK.match(_ggml().ggml_get_name(tensor) or b"")
        if match is None or match.group(1).decode() != self.mode:
            return not ask
        if ask:
            return True
        layer, data = int(match.group(2)), _tensor_f32(tensor)
        if data is not None:
            self._stash(layer, data)
        return True

    def _stash(self, layer: int, data: np.ndarray) -> None:
        if self.mode == "Qcur":
            self._query[layer] = data
            return
        if layer == 0 and self.n_layer - 1 in self._last:
            self._flush_keys()  # layer 0 again: the next ubatch began
        self._last[layer] = data


VIEW_SEQ = 1  # the view's sequence id in a one-slot context with views


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
    """

    def __init__(self, model: Model, *, n_ctx: int, n_batch: int, n_ubatch: int, n_threads: int,
                 flash_attn: bool, capture: AttentionCapture | None = None, views: bool = False,
                 probe: QKCapture | None = None, n_seq: int = 1, unified: bool | None = None) -> None:
        self.model = model
        unified = (views or n_seq == 1) if unified is None else unified
        if views and not unified:
            raise EngineError("sequence views need a unified KV cache")
        params = llama_cpp.llama_context_default_params()
        params.n_seq_max = n_seq + (1 if views else 0)
        params.n_ctx = n_ctx * n_seq if unified else n_ctx * params.n_seq_max
        params.n_batch = n_batch
        params.n_ubatch = n_ubatch
        params.kv_unified = unified
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.no_perf = True
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self.capture, self.probe = capture, probe
        if capture is not None:
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED  # no kq_soft_max with FA
            params.cb_eval = capture.callback
            params.cb_eval_user_data = None
        elif probe is not None:
            params.cb_eval = probe.callback
            params.cb_eval_user_data = None
        self._ptr = llama_cpp.llama_init_from_model(model._ptr, params)
        if not self._ptr:
            raise EngineError(f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq={n_seq})")
        # per sequence: a unified pool lets one sequence grow to the whole pool, but a slot is
        # promised n_ctx; split streams are padded by llama.cpp to a multiple of 256
        self.n_ctx = n_ctx if unified else int(llama_cpp.llama_n_ctx_seq(self._ptr))
        self.n_seq, self.unified = n_seq, unified
        self.view_seq = n_seq if views else -1
        self.n_batch = n_batch
        self._mem = llama_cpp.llama_get_memory(self._ptr)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 2)
        self.abort: Callable[[], bool] | None = None  # checked between batches: a cancelled turn stops there

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
    def clear(self) -> None:
        """Empty every sequence."""
        llama_cpp.llama_memory_clear(self._mem, True)

    def seq_pos_max(self, seq_id: int) -> int:
        """The last position any cell of ``seq_id`` holds (-1: none); also for the view."""
        return int(llama_cpp.llama_memory_seq_pos_max(self._mem, seq_id))

    def copy_seq(self, src: int, dst: int) -> None:
        """Make ``dst`` hold exactly ``src``'s cells (between split streams: a buffer copy)."""
        llama_cpp.llama_memory_seq_rm(self._mem, dst, -1, -1)
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, -1, -1)

    # -- decoding -----------------------------------------------------------
    def decode(self, tokens: Sequence[int], start_pos: int, logits_last: bool = True,
               logits_all: bool = False, seqs: tuple[int, ...] = (0,),
               abort: Callable[[], bool] | None = None) -> None:
        """Decode ``tokens`` at positions start_pos.. in batches of n_batch.

        ``logits_all`` keeps every token's logits (one batch at most, read with
        :meth:`logits_at`).  ``seqs[0]`` picks the cells attended; every id in
        ``seqs`` holds the new cells.  ``abort`` (else the context's) is polled between
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
        ptr = llama_cpp.llama_get_logits_ith(self._ptr, i)
        if not ptr:
            raise EngineError(f"no logits for batch index {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy()

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

    def clear(self) -> None:
        llama_cpp.llama_memory_seq_rm(self._mem, self.id, -1, -1)

    def remove_from(self, pos: int) -> None:
        if not llama_cpp.llama_memory_seq_rm(self._mem, self.id, pos, -1):
            raise EngineError(f"could not remove KV cells from position {pos}")

    def shift(self, p0: int, p1: int, delta: int) -> None:
        llama_cpp.llama_memory_seq_add(self._mem, self.id, p0, p1, delta)

    def make_view(self, spans: Sequence[tuple[int, int]]) -> None:
        """Tag the cells at positions [p0, p1) of each span with the view sequence.
        A batch decoded through the view must start right after its last cell."""
        if self.ctx.view_seq < 0:
            raise EngineError("this context has no view sequence (SpecAttn needs a unified cache)")
        self.drop_view()
        for p0, p1 in spans:
            llama_cpp.llama_memory_seq_cp(self._mem, self.id, self.ctx.view_seq, p0, p1)

    def commit_view(self, p0: int, p1: int) -> None:
        """Make the view's cells at positions [p0, p1) part of this sequence too."""
        llama_cpp.llama_memory_seq_cp(self._mem, self.ctx.view_seq, self.id, p0, p1)

    def drop_view(self) -> None:
        llama_cpp.llama_memory_seq_rm(self._mem, self.ctx.view_seq, -1, -1)

    def save(self) -> bytes:
        """Serialize this sequence's KV cells (llama_state_seq_get_data)."""
        size = llama_cpp.llama_state_seq_get_size(self.ptr, self.id)
        buf = (ctypes.c_uint8 * size)()
        n = llama_cpp.llama_state_seq_get_data(self.ptr, buf, size, self.id)
        return ctypes.string_at(buf, n)

    def load(self, blob: bytes) -> None:
        """Replace this sequence's cells with ones saved by :meth:`save` (b"": empty it)."""
        self.clear()
        if not blob:
            return
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        if llama_cpp.llama_state_seq_set_data(self.ptr, buf, len(blob), self.id) == 0:
            self.clear()
            raise EngineError("could not restore a saved KV sequence")
