"""Prompt-lookup drafts, pure numpy: the longest suffix of the tokens so far found earlier,
what followed it, and the draft length adapted to acceptance (used by core.decoding.lookup;
kept apart so that its policy is tested without llama.cpp)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NUMBERED = re.compile(r"(?m)^ *\d+\t")  # cat -n / Read: a line's number and a tab
MAX_VIEW_CHARS = 65536

K_MIN, K_MAX = 2, 16
MAX_BACKOFF = 32  # plain steps between drafts at most, after misses in a row
MAX_CONTEXT_MATCH = 32  # tokens before a suffix's occurrences compared to choose among them


class Drafter:
    """The tokens so far, and drafts looked up in them (pure numpy)."""

    def __init__(self, context: Sequence[int], max_ngram: int = 4, min_ngram: int = 2) -> None:
        self._buf = np.zeros(max(1024, 2 * len(context)), dtype=np.int64)
        self._n = 0
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.extend(context)

    def extend(self, tokens: Sequence[int]) -> None:
        if self._n + len(tokens) > len(self._buf):
            self._buf = np.concatenate([self._buf, np.zeros(len(self._buf) + len(tokens), dtype=np.int64)])
        self._buf[self._n:self._n + len(tokens)] = tokens
        self._n += len(tokens)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix found
        (``max_ngram`` down to ``min_ngram`` tokens): the one matching furthest back, the most
        recent of those; [] when none is."""
        t, n = self._buf, self._n
        for size in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            starts = n - size  # the suffix starts here; an earlier occurrence starts before it
            hit = t[:starts] == t[starts]
            for j in range(1, size):
                hit &= t[j:starts + j] == t[starts + j]
            found = np.flatnonzero(hit)
            if found.size:
                at = _best(t, found, starts) + size
                return t[at: min(at + k, n)].tolist()
        return []


def _best(t: np.ndarray, found: np.ndarray, starts: int, reach: int = MAX_CONTEXT_MATCH) -> int:
    """Of the earlier occurrences ``found`` of the suffix starting at ``starts``, the one whose
    match runs furthest back (up to ``reach`` more tokens), the latest among equals.  In a
    deep context a short n-gram (``    return``, ``_total =``) recurs in every module read; the
    occurrence that also matches the tokens before it is the one being copied."""
    alive = np.ones(found.size, dtype=bool)
    run = np.zeros(found.size, dtype=np.int64)
    for back in range(1, min(reach, starts) + 1):
        prev = found - back
        alive &= prev >= 0
        alive[alive] &= t[prev[alive]] == t[starts - back]
        if not alive.any():
            break
        run += alive
    return int(found[np.flatnonzero(run == run.max())[-1]])


@dataclass(slots=True)
class Lookup:
    """The draft length, adapted to acceptance, and a back-off after drafts that missed: a
    reply that stopped copying (prose after a quoted line) decodes plainly for a while, each
    miss in a row doubling the wait, so a free reply pays little for lookup."""

    k: int = 8
    wait: int = 0  # plain steps left before the next draft
    backoff: int = 0  # the wait after the next miss

    def adapt(self, drafted: int, accepted: int) -> None:
        self.k = min(K_MAX, self.k * 2) if accepted == drafted else max(K_MIN, accepted + 1)
        if accepted:
            self.backoff = 0
        else:
            self.backoff = min(MAX_BACKOFF, max(1, 2 * self.backoff))
            self.wait = self.backoff

    def ready(self) -> bool:
        """Whether this step may draft (one plain step of the wait passes when not)."""
        if self.wait:
            self.wait -= 1
            return False
        return True


def copy_views(results: Sequence[str]) -> list[str]:
    """Tool results as a reply copies them, for the drafter to look up beside the prompt:
    a file read without its ``cat -n`` numbers (a ``Write`` or a code block copies the code,
    not the numbers), and each of those as a JSON string's inside (an ``Edit``'s ``old_string``
    escapes newlines and quotes).  Newest first, ``MAX_VIEW_CHARS`` in all."""
    views: list[str] = []
    left = MAX_VIEW_CHARS
    for text in reversed(results):
        plain = NUMBERED.sub("", text)
        for view in ([plain] if plain != text else []) + [json.dumps(plain, ensure_ascii=False)[1:-1]]:
            if len(view) > left:
                return views
            views.append(view)
            left -= len(view)
    return views
