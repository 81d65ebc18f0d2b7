"""Reading ggml tensors from inside the eval callback: the ``ggml_tensor`` struct, strided
views of f32/f16 data (and of q8_0 blocks, dequantized), and the inputs of a
flash-attention node (for :class:`core.llama.capture.FlashCapture`)."""

from __future__ import annotations

import ctypes
import functools
import re

import numpy as np

from core.errors import EngineError
from core.llama.attention_rows import Q8_0_BLOCK, FlashInputs, dequantize_q8_0
from core.llama.backend import _ggml

_DTYPES = {0: np.float32, 1: np.float16}  # GGML_TYPE_F32, GGML_TYPE_F16
GGML_TYPE_Q8_0 = 8
TYPE_NAMES = {0: "f32", 1: "f16", GGML_TYPE_Q8_0: "q8_0"}
_CACHE_K = re.compile(rb"^cache_\w*k_l(\d+)")


class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` of the vendored ggml.h (GGML_MAX_SRC 10, 64 bytes of op
    params, 64-byte names); :func:`_checked` compares its size with the library's."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


@functools.cache
def _checked() -> ctypes.CDLL:
    lib = _ggml()
    lib.ggml_tensor_overhead.restype = ctypes.c_size_t
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    object_size = 32  # struct ggml_object: offs, size, next, type + 4 bytes of padding
    if lib.ggml_tensor_overhead() - object_size != ctypes.sizeof(GgmlTensor):
        raise EngineError("this llama.cpp's ggml_tensor layout differs from core.llama.tensors.GgmlTensor")
    return lib


def tensor_at(address: int) -> GgmlTensor:
    _checked()
    return GgmlTensor.from_address(address)


def read_view(address: int) -> np.ndarray:
    """A tensor's elements as [ne3, ne2, ne1, ne0], following its strides (permuted views
    included): the bytes it spans are copied once."""
    t = tensor_at(address)
    if t.type not in TYPE_NAMES:
        raise EngineError(f"cannot read tensor {t.name!r} of ggml type {t.type}: f32, f16 and q8_0 only")
    nbytes = _checked().ggml_nbytes(address)
    raw = np.empty(nbytes, dtype=np.uint8)
    _ggml().ggml_backend_tensor_get(address, raw.ctypes.data, 0, nbytes)
    if t.type == GGML_TYPE_Q8_0:  # ne[0] counts elements, nb[0] is one 32-element block
        shape = (*reversed(t.ne[1:]), t.ne[0] // 32)
        blocks = np.ndarray(shape, dtype=Q8_0_BLOCK, buffer=raw, strides=tuple(reversed(t.nb)))
        return dequantize_q8_0(blocks)
    return np.ndarray(tuple(reversed(t.ne)), dtype=_DTYPES[t.type], buffer=raw, strides=tuple(reversed(t.nb)))


def _root_name(address: int) -> bytes:
    t = tensor_at(address)
    while t.view_src:
        t = tensor_at(t.view_src)
    return t.name


def flash_inputs(address: int) -> tuple[int, FlashInputs]:
    """A FLASH_ATTN_EXT node's layer (from the cache tensor its K view reads) and its
    first stream's inputs."""
    node = tensor_at(address)
    scale, max_bias, softcap = (ctypes.c_float * 3).from_buffer_copy(bytes(node.op_params)[:12])
    if max_bias != 0.0 or node.src[4]:
        raise EngineError("flash capture does not handle ALiBi or attention sinks; use --attention-capture softmax")
    match = _CACHE_K.match(_root_name(node.src[1]))
    if match is None:
        raise EngineError("a flash-attention node that reads no KV cache tensor")
    q, k, mask = read_view(node.src[0])[0], read_view(node.src[1])[0], read_view(node.src[3])[0, 0]
    n_kv = node.op_params[4] or k.shape[1]  # a node may attend only its first n_kv_max keys
    k_type = TYPE_NAMES[tensor_at(node.src[1]).type]
    return int(match.group(1)), FlashInputs(q, k[:, :n_kv], mask[:, :n_kv], float(scale), float(softcap), k_type)
