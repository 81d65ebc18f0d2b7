"""Moving cached K to another position: the rotary embedding applied again (pure numpy).

A cell's K is stored rotated for its position ``p``; rotating it by ``delta`` gives the K of
the same token at ``p + delta``, since rotations compose.  This is what llama.cpp's K-shift
does (``ggml_rope_ext`` on the cache), here on the rows of a saved sequence, so a run of
cells can be reused at another position without a K-shift of the whole context.  Plain RoPE
only (``NORM``: pairs of adjacent dimensions; ``NEOX``: the two halves), no YaRN or
multi-section variants: :func:`Rope` callers refuse those.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.errors import EngineError
from core.llama.model import Model


@dataclass(slots=True, frozen=True)
class Rope:
    n_head_kv: int
    head_dim: int
    n_rot: int  # leading dimensions of each head that rotate
    freq_base: float
    freq_scale: float
    neox: bool

    def __post_init__(self) -> None:
        if not (0 < self.n_rot <= self.head_dim and self.n_rot % 2 == 0):
            raise EngineError(f"rotary dimensions must be even and at most the head size, "
                              f"got {self.n_rot}/{self.head_dim}")

    def angles(self, delta: int) -> np.ndarray:
        """The rotation angle of each pair of dimensions for a move of ``delta`` positions."""
        i = np.arange(self.n_rot // 2, dtype=np.float64)
        return delta * self.freq_scale * self.freq_base ** (-2.0 * i / self.n_rot)


def model_rope(model: Model) -> Rope | None:
    """``model``'s rotary embedding, when it is one this module can apply again."""
    params = model.rope_params()
    return Rope(**params) if params is not None else None


def rotate(k: np.ndarray, delta: int, rope: Rope) -> np.ndarray:
    """K rows (``cells x n_head_kv*head_dim``, any float type) rotated by ``delta`` positions,
    as float32."""
    x = k.astype(np.float32).reshape(len(k), rope.n_head_kv, rope.head_dim)
    theta = rope.angles(delta)
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    half = rope.n_rot // 2
    if rope.neox:
        a, b = x[..., :half], x[..., half:rope.n_rot]
    else:
        a, b = x[..., 0:rope.n_rot:2], x[..., 1:rope.n_rot:2]
    a2, b2 = a * cos - b * sin, a * sin + b * cos
    a[...], b[...] = a2, b2  # x is this call's own copy: rotated in place
    return x.reshape(len(k), -1)
