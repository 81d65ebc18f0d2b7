"""The one check SpecGate makes on a model file before llama.cpp opens it: that it is a
readable GGUF file (llama.cpp itself only logs why a load failed).  Pure Python: the
unit tests use it without the native library."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from core.errors import ModelFileError


def validate_gguf(path: str | Path) -> Path:
    """``path`` as a readable GGUF file, or a :class:`ModelFileError` that says what is wrong."""
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


Scalar = int | float | bool | str
# GGUF value types (gguf's GGUFValueType) and the struct format of each fixed-size one
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def scalar_fields(path: str | Path) -> dict[str, Scalar]:
    """The scalar key-values of a GGUF file's header; arrays (the tokenizer's vocabulary and
    merges) are stepped over unread.  gguf's ``GGUFReader`` builds a numpy view per array
    element: 15-35 s for Qwen's 151K-token vocabulary on a 2-core EPYC, where this takes a
    fraction of a second."""
    p = validate_gguf(path)
    try:
        with p.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _Header(buf).fields()
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise ModelFileError(f"GGUF header unreadable: {p}: {exc}") from exc


class _Header:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.at = buf, 4

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.at += n
        return bytes(self.buf[self.at - n:self.at]).decode()

    def skip(self, kind: int, count: int) -> None:
        if kind in _FIXED:
            self.at += struct.calcsize(_FIXED[kind]) * count
        elif kind == _STRING:
            for _ in range(count):
                self.at += 8 + self.take("Q")
        elif kind == _ARRAY:
            for _ in range(count):
                inner = self.take("I")
                self.skip(inner, self.take("Q"))
        else:
            raise ValueError(f"unknown value type {kind}")

    def fields(self) -> dict[str, Scalar]:
        version = self.take("I")
        if not 2 <= version <= 3:  # 1 had 32-bit lengths, long gone
            raise ValueError(f"GGUF version {version} (a big-endian file?)")
        self.take("Q")  # tensor count
        out: dict[str, Scalar] = {}
        for _ in range(self.take("Q")):
            key, kind = self.string(), self.take("I")
            if kind in _FIXED:
                out[key] = self.take(_FIXED[kind])
            elif kind == _STRING:
                out[key] = self.string()
            else:
                self.skip(kind, 1)  # an array (or an unknown type: ValueError)
        return out
