"""Which tokens a session gives up when its next turn would not fit the window (issue 54).

A conversation longer than the model's window keeps going: before a turn whose prompt and
reply would pass the window, the session's cells are cut down to what matters and packed
(core.kv.packing).  This module is the choice alone, over logical tokens, with no model:

* never dropped: the system prompt and tools, the user's own words, assistant messages that
  call tools, and the template tokens that open and close each message; and, where the
  window allows, the most recent ``recent`` tokens (a tool result larger than the free window
  is cut too, rather than refused).  An earlier user message longer than ``USER_WHOLE`` keeps
  its first ``USER_HEAD`` and last ``USER_TAIL`` tokens, and its middle is scored like a tool
  result: clients put files there (Claude Code attaches an ``@file`` mention, and re-attaches
  recently read files after compacting, as reminders inside the user message, before the
  words typed last), and a session whose every attached file must stay would be refused again
  as soon as the window fills.  The last user message, the request itself, stays whole: a
  request larger than the window is refused, not cut;
* dropped first: the chunks of older tool results and replies the speculator scored lowest
  (the session keeps each token's latest importance: core.kv.positions.SessionKV.scores);
  chunks no turn scored go after every scored one, oldest first (that is the anchors'
  context shift, for a prompt that arrives with no cache at all).

Tokens are dropped a chunk at a time, so what stays reads in whole pieces, until ``need``
cells are free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.errors import PromptTooLong
from core.kv.positions import TokenCells
from core.prompt import Prompt, Span

CHUNK = 32  # tokens dropped together
EDGE_OPEN, EDGE_CLOSE = 6, 3  # a message's template tokens kept at its start and end
USER_WHOLE, USER_HEAD, USER_TAIL = 512, 128, 256  # a user message kept whole, or its two ends


def protected(n: int, spans: Sequence[Span], recent: int) -> np.ndarray:
    """The logical tokens of an ``n``-token prompt that stay whatever the scores say."""
    keep = np.zeros(n, dtype=bool)
    keep[max(0, n - recent):] = True
    last_user = max((i for i, s in enumerate(spans) if s.role == "user"), default=-1)
    for i, s in enumerate(spans):
        head, tail = _kept_ends(s, latest=i == last_user)
        keep[s.start:min(s.end, s.start + head)] = True
        keep[max(s.start, s.end - tail):s.end] = True
    if not spans:
        keep[:] = True  # a raw prompt: nothing tells a tool result from an instruction
    return keep


def _kept_ends(s: Span, latest: bool) -> tuple[int, int]:
    """How many tokens at the start and end of message ``s`` always stay (all: the whole);
    ``latest``: the last user message, the request itself, stays whole."""
    size = s.end - s.start
    if s.role == "system" or s.tool_calls or (s.role == "user" and (latest or size <= USER_WHOLE)):
        return size, 0
    if s.role == "user":
        return USER_HEAD, USER_TAIL
    return EDGE_OPEN, EDGE_CLOSE


def choose(candidates: np.ndarray, scores: np.ndarray, need: int, chunk: int = CHUNK) -> np.ndarray:
    """The logical indices to drop (ascending) among ``candidates`` (a mask over logical
    tokens), lowest scored chunk first, unscored (NaN) chunks after, oldest first, until at
    least ``need`` are chosen; fewer when the candidates run out."""
    idx = np.flatnonzero(candidates)
    if need <= 0 or idx.size == 0:
        return np.zeros(0, dtype=np.int64)
    group = idx // chunk
    ids, first, counts = np.unique(group, return_index=True, return_counts=True)
    sums = np.add.reduceat(np.nan_to_num(scores[idx], nan=0.0), first)
    known = np.add.reduceat((~np.isnan(scores[idx])).astype(np.int64), first)
    mean = np.where(known > 0, sums / np.maximum(known, 1), np.inf)
    order = np.lexsort((ids, mean))  # by score, then age
    taken = np.cumsum(counts[order])
    chosen = order[: int(np.searchsorted(taken, need)) + 1]
    return np.sort(idx[np.isin(group, ids[chosen])])


@dataclass(slots=True, frozen=True)
class Fit:
    """What a session holds after fitting a turn into the window: ``keep``, a mask over the
    prompt's first ``through`` logical tokens (the cached history and, when even that is not
    enough, the oldest new tokens, prefilled now without the dropped ones), and how many
    cells or new tokens it gives up."""

    keep: np.ndarray
    through: int
    dropped: int


def plan_fit(prompt: Prompt, target: TokenCells, scores: np.ndarray, window: int, reply: int,
             recent: int) -> Fit | None:
    """How the turn's prompt fits ``window`` cells with ``reply`` left for the reply: None when
    it does as the session holds it.  Else the session packs its cells and drops enough of
    them to be back at a quarter of the window free (so the next few turns fit as they are),
    keeping the ``recent`` last tokens when it can.  New tokens (past the cache) go only as
    far as the turn must, to fit at all: no turn has scored them, and the turn is about them.
    ``target``: the session's cells, cut back to its common prefix with the prompt;
    ``scores``: each prompt token's importance (NaN: none).  Raises :class:`PromptTooLong`
    when what must stay does not fit."""
    n, q = len(prompt), len(target.tokens)
    if target.end_pos + (n - q) + reply <= window:
        return None
    held = np.ones(n, dtype=bool)
    held[:q] = np.asarray(target.kv_pos, dtype=np.int64) >= 0
    cells = int(held.sum())
    least, ample = cells + reply - window, cells + reply - (window - window // 4)
    cached = np.arange(n) < q
    for r in (recent, 0):
        free = held & ~protected(n, prompt.spans, r)
        drop = choose(free & cached, scores, ample)
        if drop.size < least:
            drop = np.union1d(drop, choose(free & ~cached, scores, least - drop.size))
        if drop.size >= least:
            break
    else:
        raise PromptTooLong(cells - drop.size + reply, window, "what a turn must keep of the prompt, and its reply,")
    keep = held.copy()
    keep[drop] = False
    # through the first token kept after the last one dropped: the packed cells end with a
    # cell, so the turn's own tokens follow them with no gap (a message's closing tokens stay)
    through = min(max(q, int(drop[-1]) + 2), n - 1) if drop.size else q
    return Fit(keep[:through], through, int(drop.size))
