"""Attention capture through the eval callback: the softmax rows SpecPrefill scores from
(:class:`AttentionCapture` reads llama.cpp's ``kq_soft_max``, which exists only with flash
attention off; :class:`FlashCapture` recomputes the same rows from the inputs of each
flash-attention node, so the scoring model runs with flash attention on), and post-RoPE
queries and keys (:class:`QKCapture`, the evals)."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from core.errors import EngineError
from core.llama.attention_rows import attention_rows
from core.llama.backend import _NE_OFFSET, _QK, _SOFTMAX, _ggml
from core.llama.tensors import flash_inputs, read_view, tensor_at


class AttentionCapture:
    """cb_eval hook that copies the last query row of every ``kq_soft_max-*`` tensor
    (its context runs with flash attention off).

    Only the wanted row is read, per head, with ``ggml_backend_tensor_get`` at
    the row's byte offset: the N x N matrix is never copied.
    """

    flash_attn = False  # the context this hook reads must run without flash attention

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


class FlashCapture(AttentionCapture):
    """The same rows as :class:`AttentionCapture`, from a context with flash attention on.

    llama.cpp's flash-attention node never forms the softmax, so for each layer the hook
    reads the node's inputs (the post-RoPE queries, the K view of the cache the node
    attends, the mask, the scale) and computes the last query's softmax row over the
    keys in numpy, as ``kq_soft_max`` would hold it (core.llama.tensors).  The rest of
    the prefill is a plain flash-attention forward pass: only the captured steps ask to
    see these nodes."""

    flash_attn = True

    def _on_eval(self, tensor: int, ask: bool, user_data: int) -> bool:
        if not self.active:
            return not ask
        is_fattn = _ggml().ggml_op_desc(tensor) == b"FLASH_ATTN_EXT"
        if ask:
            return is_fattn
        if is_fattn:
            layer, inputs = flash_inputs(tensor)
            self._rows[layer] = attention_rows(inputs)[:, : self.n_keys]
        return True


def make_capture(kind: str, n_layer: int) -> AttentionCapture:
    """``kind``: ``flash`` or ``softmax`` (see core.models.prefill_settings.scoring_capture)."""
    return FlashCapture(n_layer) if kind == "flash" else AttentionCapture(n_layer)


def _tensor_f32(tensor: int) -> np.ndarray | None:
    """A contiguous f32 tensor's data as [ne2, ne1, ne0]; None for anything else."""
    t = tensor_at(tensor)
    if t.type != 0 or t.nb[0] != 4 or t.nb[1] != 4 * t.ne[0] or t.nb[2] != t.nb[1] * t.ne[1]:
        return None  # GGML_TYPE_F32, rows and planes packed
    return read_view(tensor)[0]


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
