"""Speculative decoding's acceptance rules (pure numpy).

Greedy: accept the longest prefix of drafts that equals the target's argmax, then
take the target's own token.  Sampling: standard speculative rejection sampling
(Leviathan et al. 2023; Chen et al. 2023) -- accept draft d with probability
min(1, p(d)/q(d)), on rejection sample from norm(max(0, p - q)), and after a fully
accepted draft sample a bonus token from p -- so every emitted token is
distributed exactly as the target's (temperature, top-k, top-p applied to both).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.policies import SamplingParams


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The sampling distribution the sampler chain would draw from (temperature > 0):
    top-k, then top-p (at least one token), then softmax at the temperature."""
    z = np.asarray(logits, dtype=np.float64)
    keep = np.ones(z.shape, dtype=bool)
    if 0 < params.top_k < z.size:
        keep[:] = False
        keep[np.argpartition(-z, params.top_k - 1)[: params.top_k]] = True
    if params.top_p < 1.0:
        # llama.cpp's top-p works on the softmax at temperature 1 over the surviving tokens
        order = np.argsort(-np.where(keep, z, -np.inf), kind="stable")[: int(keep.sum())]
        w = np.exp(z[order] - z[order[0]])
        cum = np.cumsum(w / w.sum())
        n = int(np.searchsorted(cum, params.top_p) + 1)
        keep[:] = False
        keep[order[:n]] = True
    scaled = np.where(keep, z / params.temperature, -np.inf)
    e = np.exp(scaled - scaled.max())
    return np.asarray(e / e.sum())


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), probs.size - 1))


def accept_greedy(target_logits: Sequence[np.ndarray], drafts: Sequence[int]) -> tuple[int, int]:
    """``target_logits[i]`` predicts the token after draft i (row 0: after the verified
    input token).  Returns (drafts accepted, the target's next token)."""
    for i, d in enumerate(drafts):
        best = int(np.argmax(target_logits[i]))
        if best != d:
            return i, best
    return len(drafts), int(np.argmax(target_logits[len(drafts)]))


def accept_stochastic(target_probs: Sequence[np.ndarray], draft_probs: Sequence[np.ndarray],
                      drafts: Sequence[int], rng: np.random.Generator) -> tuple[int, int]:
    """Rejection sampling over one draft; returns (drafts accepted, the next token)."""
    for i, d in enumerate(drafts):
        p, q = target_probs[i], draft_probs[i]
        if rng.random() * q[d] < p[d]:  # accept with probability min(1, p/q)
            continue
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        return i, sample(residual / total if total > 0 else p, rng)
    return len(drafts), sample(target_probs[len(drafts)], rng)
