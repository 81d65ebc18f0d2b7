"""Which decoding mode is fastest at a depth, from this machine's own decodes (pure numpy).

Speculative decoding pays where a draft step and a batched verify cost little against the
target's one-token step; on the 2-core VM plain decoding won at every depth measured
(results/specattn.md, results/depth.md), on other hardware it need not.  So the engine
does not assume: every decoded reply is a measurement of its mode's seconds per token at
its depth, fitted per mode as ``a + b*depth`` (the weights, and attention over the context),
and ``--decode-auto`` turns take the mode the fits say is fastest at their depth.  A mode is
picked only against a measured plain decode: an unmeasured mode is never guessed at, and with
nothing measured the answer is plain.  Modes get measured when requests ask for them.

Prompt lookup (core.decoding.lookup) pays on replies that copy their context and costs little
elsewhere, so its speed depends on the turn more than on the depth: turns are measured apart
by ``kind`` -- ``copy`` (the prompt ends with a tool result, or the reply is a forced call: what
agents copy from) or ``free`` -- and a copy turn tries lookup until lookup has been measured
for that kind (with no draft, a lookup step is a plain one).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from core.policies import DecodeMode

MIN_TOKENS = 8  # a shorter reply is mostly its first step's overhead: not a measure of the mode
SAMPLES = 32  # per mode, the most recent


COPY, FREE = "copy", "free"  # turn kinds (see the module notes)


@dataclass(slots=True)
class ModeSpeeds:
    samples: dict[tuple[DecodeMode, str], deque[tuple[int, float]]] = field(default_factory=dict)  # (depth, s/tok)

    def observe(self, mode: DecodeMode, depth: int, n_tokens: int, seconds: float, kind: str = FREE) -> None:
        if n_tokens >= MIN_TOKENS and seconds > 0:
            self.samples.setdefault((mode, kind), deque(maxlen=SAMPLES)).append((depth, seconds / n_tokens))

    def seconds_per_token(self, mode: DecodeMode, depth: int, kind: str = FREE) -> float | None:
        """The fit's seconds per token at ``depth`` (None: the mode was never measured)."""
        got = self.samples.get((mode, kind))
        if not got:
            return None
        a, b = fit(np.array(got, dtype=np.float64))
        return a + b * depth

    def pick(self, depth: int, modes: Iterable[DecodeMode], kind: str = FREE) -> DecodeMode:
        """The fastest of ``modes`` at ``depth`` by measurement, for turns of ``kind``; plain
        unless one measured faster -- except that a copy turn tries lookup, if offered, until
        lookup has been measured on copy turns."""
        modes = list(modes)
        plain = self.seconds_per_token(DecodeMode.PLAIN, depth, kind)
        if kind == COPY and DecodeMode.LOOKUP in modes and (DecodeMode.LOOKUP, kind) not in self.samples:
            return DecodeMode.LOOKUP
        best, best_s = DecodeMode.PLAIN, plain
        if plain is None:
            return best
        for mode in modes:
            s = self.seconds_per_token(mode, depth, kind)
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
