"""Which decoding mode is fastest at a depth, from this machine's own decodes (pure numpy).

Speculative decoding pays where a draft step and a batched verify cost little against the
target's one-token step; on the 2-core VM plain decoding won at every depth measured
(results/specattn.md, results/depth.md), on other hardware it need not.  So the engine
does not assume: every decoded reply is a measurement of its mode's seconds per token at
its depth, fitted per mode as ``a + b*depth`` (the weights, and attention over the context),
and ``--decode-auto`` turns take the mode the fits say is fastest at their depth.  A mode is
picked only against a measured plain decode: an unmeasured mode is never guessed at, and with
nothing measured the answer is plain.  Modes get measured when requests ask for them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from core.policies import DecodeMode

MIN_TOKENS = 8  # a shorter reply is mostly its first step's overhead: not a measure of the mode
SAMPLES = 32  # per mode, the most recent


@dataclass(slots=True)
class ModeSpeeds:
    samples: dict[DecodeMode, deque[tuple[int, float]]] = field(default_factory=dict)  # (depth, s/token)

    def observe(self, mode: DecodeMode, depth: int, n_tokens: int, seconds: float) -> None:
        if n_tokens >= MIN_TOKENS and seconds > 0:
            self.samples.setdefault(mode, deque(maxlen=SAMPLES)).append((depth, seconds / n_tokens))

    def seconds_per_token(self, mode: DecodeMode, depth: int) -> float | None:
        """The fit's seconds per token at ``depth`` (None: the mode was never measured)."""
        got = self.samples.get(mode)
        if not got:
            return None
        a, b = fit(np.array(got, dtype=np.float64))
        return a + b * depth

    def pick(self, depth: int, modes: Iterable[DecodeMode]) -> DecodeMode:
        """The fastest of ``modes`` at ``depth`` by measurement; plain unless one measured faster."""
        plain = self.seconds_per_token(DecodeMode.PLAIN, depth)
        best, best_s = DecodeMode.PLAIN, plain
        if plain is None:
            return best
        for mode in modes:
            s = self.seconds_per_token(mode, depth)
            if s is not None and best_s is not None and s < best_s:
                best, best_s = mode, s
        return best


def fit(samples: np.ndarray) -> tuple[float, float]:
    """``a, b >= 0`` with seconds per token ``a + b*depth``, least squares on relative error;
    one depth (or a slope the data make negative): the mean, flat."""
    depth, y = samples[:, 0], samples[:, 1]
    if np.ptp(depth) > 0:
        x = np.stack([np.ones_like(depth), depth], axis=1) / y[:, None]
        (a, b), *_ = np.linalg.lstsq(x, np.ones_like(y), rcond=None)
        if a >= 0 and b >= 0:
            return float(a), float(b)
    return float(np.mean(y)), 0.0
