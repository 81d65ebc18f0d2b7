"""The one check SpecGate makes on a model file before llama.cpp opens it: that it is a
readable GGUF file (llama.cpp itself only logs why a load failed).  Pure Python: the
unit tests use it without the native library."""

from __future__ import annotations

from pathlib import Path

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
