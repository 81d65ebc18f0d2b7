"""Constrained decoding on the model thread: llguidance masks the logits of one reply.

The vocabulary is read once per model (about 2 s for Qwen's 151K tokens) and
kept; each reply compiles its :class:`~core.constraints.Constraint` into a
matcher (milliseconds), and every constrained token costs one mask (tens of
microseconds) plus writing ``-inf`` over the banned logits in place, before
llama.cpp's sampler chain reads them.  A lazy constraint stays off until the
model samples its trigger token.  Speculative decoding masks the draft's logits and each
verified row the same way, and rolls the matcher back over the drafts the target rejects.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import numpy as np

from core.constraints import Constraint
from core.errors import InvalidRequest

_tokenizers: dict[tuple[int, int, str], Any] = {}  # (vocab address, n_vocab, model file) -> LLTokenizer
_lock = threading.Lock()


def tokenizer_key(model: Any) -> tuple[int, int, str]:
    """The vocabulary's address alone is not a name: a model closed and another loaded may get
    the same one, and the first's tokenizer then builds masks of the wrong size for it (the
    suite's SmolLM2 engine, after a Qwen model freed at that address: "Invalid buffer size")."""
    address = int(model.vocab) if isinstance(model.vocab, int) else id(model)
    return address, int(model.n_vocab), str(getattr(model, "path", ""))


def tokenizer_for(model: Any) -> Any:
    from llguidance.llamacpp import lltokenizer_from_vocab

    key = tokenizer_key(model)
    with _lock:
        if key not in _tokenizers:
            with warnings.catch_warnings():  # it calls a deprecated llama.cpp binding once per token
                warnings.simplefilter("ignore", DeprecationWarning)
                _tokenizers[key] = lltokenizer_from_vocab(model.vocab)
        return _tokenizers[key]


class Guide:
    """One reply's constraint: :meth:`mask` before sampling, :meth:`accept` after."""

    def __init__(self, model: Any, constraint: Constraint) -> None:
        import llguidance

        tokenizer = tokenizer_for(model)  # once per model: not part of a reply's compile time
        t0 = time.perf_counter()
        opening = model.tokenize(constraint.syntax.open, add_special=False, parse_special=True)
        special = len(opening) == 1 and tokenizer.is_special_token(opening[0])
        self.matcher = llguidance.LLMatcher(tokenizer, constraint.grammar(special), log_level=0)
        if self.matcher.is_error():
            raise InvalidRequest(f"the requested output format cannot be enforced: {self.matcher.get_error()}")
        self.compile_s = time.perf_counter() - t0
        self.n_vocab = model.n_vocab
        self.bits = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
        # lazy: armed when the model emits the opening tag; a vocabulary without it as one
        # special token leaves the reply free (the parser alone reads what calls it writes)
        self.armed = not constraint.lazy
        self.trigger = opening[0] if constraint.lazy and special else -1
        self.mask_s = 0.0
        self.kind = constraint.kind
        self._trail: list[str] = []  # per accepted token: "c" consumed by the matcher, "a" armed it, "" neither

    def mask(self, logits: np.ndarray) -> None:
        """Ban, in ``logits`` (a context's, in place), every token the grammar forbids."""
        if not self.armed:
            return
        t0 = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        allowed = np.unpackbits(self.bits.view(np.uint8), count=self.n_vocab, bitorder="little").view(bool)
        np.copyto(logits, -np.inf, where=~allowed)
        self.mask_s += time.perf_counter() - t0

    def accept(self, token: int) -> None:
        if self.armed:
            self.matcher.consume_token(token)
            self._trail.append("c")
        elif token == self.trigger:
            self.armed = True
            self._trail.append("a")
        else:
            self._trail.append("")

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepts: a speculative round's drafts the target rejected."""
        if n <= 0:
            return
        undone = self._trail[-n:]
        del self._trail[-n:]
        if consumed := undone.count("c"):
            self.matcher.rollback(consumed)
        if "a" in undone:
            self.armed = False
