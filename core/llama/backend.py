"""The llama.cpp backend: one-time init with quiet logs, the ggml calls capture needs, and
GGUF checks.  This package is the only place that touches llama.cpp pointers; its
objects are not thread-safe, and the engine calls them from its model thread only."""

from __future__ import annotations

import ctypes
import functools
import re
import sys
import threading
from pathlib import Path

import llama_cpp

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
    lib.ggml_op_desc.restype = ctypes.c_char_p
    lib.ggml_op_desc.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return lib


# struct ggml_tensor { enum ggml_type type; ggml_backend_buffer * buffer; int64_t ne[4]; size_t nb[4]; ... }
_NE_OFFSET = ctypes.sizeof(ctypes.c_void_p) * 2
_SOFTMAX = re.compile(rb"^kq_soft_max-(\d+)$")
_QK = re.compile(rb"^(Qcur|Kcur)-(\d+)$")


