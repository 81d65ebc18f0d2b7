"""Shared prefixes: the KV of the system prompts (with their tool definitions) that
new sessions start from.

Agents of one framework open every session with the same system prompt and tools,
often thousands of tokens.  A prefix is cached once it is frequent: the first
turn that shows it is served as before (its selection may keep the system prompt
sparse), the second prefills it densely in both models and keeps both sequences'
state here, and every later session of the same owner restores it instead of
prefilling it again.  A lone agent's first session thus pays nothing extra.
Turns that arrive while it is being built wait for it rather than build it too,
so sessions that all start at once prefill it twice at most, not once each.

Entries are keyed by the owner and the exact token sequence: a session restores
only tokens its own prompt carries, and never another key's.  Their bytes live in
:class:`ParkedKV` beside the parked sessions, under the same RAM budget and LRU
order; an evicted entry is dropped (not spilled).  With a KV tier
(sessions.kv.tier), every entry is also written there, and one found there is
restored rather than built: after an eviction, after a restart, or when another
replica built it.  Model thread only, like the slot table.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from core.prompt import Prompt
from sessions.kv.parked import Blobs, ParkedKV
from sessions.kv.tier import KVTier

SEEN_KEYS = 4096  # prefixes remembered as seen once (a key each, no KV)
KEY_MARK = "\0prefix:"  # no session key starts with a NUL: the two never collide in ParkedKV


def prefix_end(prompt: Prompt, min_tokens: int) -> int:
    """Where the prompt's shareable prefix ends: after its leading system message (the
    template puts the tools there too), if that holds at least ``min_tokens`` tokens and
    something follows it; else 0 (nothing worth sharing)."""
    if not prompt.spans or prompt.spans[0].role != "system":
        return 0
    end = prompt.spans[0].end
    return end if min_tokens <= end < len(prompt) else 0


class PrefixCache:
    def __init__(self, parked: ParkedKV, min_tokens: int, tier: KVTier | None = None) -> None:
        self.parked = parked
        self.tier = tier
        self.min_tokens = min_tokens  # 0: off
        self._building: set[str] = set()
        self._seen: OrderedDict[str, None] = OrderedDict()
        # restored / built / waited for another turn's build / adopted from a resident session /
        # filled by copying a resident session's KV (no prefill)
        self.hits = self.misses = self.waits = self.adopted = self.copied = 0
        self.tier_hits = 0  # restored from the KV tier (counted in hits too)
        # entries kept without the speculator's part (copied from a session whose scorer was
        # deferred): key -> (owner, tokens), completed in idle time (core.runtime.idle_work.complete_prefix)
        self.lacking: dict[str, tuple[str, tuple[int, ...]]] = {}
        # wanted entries an idle resident session holds (a sibling conversation adopted the
        # prefix from it): key -> (owner, tokens), copied in idle time, off the reply path
        self.unfilled: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.completed = 0

    @staticmethod
    def key(owner: str, tokens: Sequence[int]) -> str:
        h = hashlib.sha256(owner.encode())
        h.update(b"\0")
        h.update(np.asarray(tokens, dtype="<i4").tobytes())
        return f"{KEY_MARK}{len(tokens)}:{h.hexdigest()}"

    def end(self, prompt: Prompt) -> int:
        return prefix_end(prompt, self.min_tokens) if self.min_tokens else 0

    def wanted(self, key: str) -> bool:
        """Whether a turn should use ``key``: it is cached (here or in the tier), being built,
        or seen before."""
        return self.building(key) or self.get(key) is not None or self.in_tier(key) or self.frequent(key)

    def in_tier(self, key: str) -> bool:
        return self.tier is not None and self.tier.has(key)

    def frequent(self, key: str) -> bool:
        """Whether ``key`` was seen before; the first time, remember it and say no."""
        if key in self._seen:
            self._seen.move_to_end(key)
            return True
        self._seen[key] = None
        if len(self._seen) > SEEN_KEYS:
            self._seen.popitem(last=False)
        return False

    def building(self, key: str) -> bool:
        return key in self._building

    def get(self, key: str) -> Blobs | None:
        return self.parked.peek(key)

    def load(self, key: str) -> tuple[Blobs | None, list[str], str]:
        """The entry from RAM, else from the tier (kept in RAM again): (blobs, the parked
        sessions evicted to make room, where it was: "ram" or "tier")."""
        if (blobs := self.get(key)) is not None or self.tier is None:
            return blobs, [], "ram"
        if (blobs := self.tier.get(key)) is None:
            return None, [], ""
        self.tier_hits += 1
        return blobs, self.parked.put(key, blobs, spill=False), "tier"

    def begin(self, key: str) -> None:
        """This turn builds ``key``; others that need it wait (see :meth:`building`)."""
        self._building.add(key)

    def forget(self, key: str) -> None:
        """Drop an entry llama.cpp could not load, here and in the tier."""
        self.parked.discard(key)
        if self.tier is not None:
            self.tier.drop(key)

    def want(self, key: str, owner: str, tokens: tuple[int, ...]) -> None:
        """``key`` is wanted and a resident session holds it: copy it in idle time
        (core.runtime.idle_work.complete_prefix), unless it is cached or being built meanwhile."""
        if key not in self.unfilled and len(self.unfilled) < SEEN_KEYS and not self.building(key) \
                and self.get(key) is None and self.wanted(key):
            self.unfilled[key] = (owner, tokens)

    def fill(self, key: str, owner: str, tokens: tuple[int, ...], blobs: Blobs) -> list[str]:
        """The entry for ``key``, copied from a resident session: kept here and in the tier
        (unless it was cached or built meanwhile).  Returns the parked sessions evicted."""
        self.unfilled.pop(key, None)
        if self.building(key) or self.get(key) is not None:
            return []
        self.note(key, owner, tokens, blobs)
        self.copied += 1
        return self.finish(key, blobs)

    def note(self, key: str, owner: str, tokens: tuple[int, ...], blobs: Blobs) -> None:
        """Remember an entry whose speculator part is missing, to complete it in idle time."""
        if not blobs[1] and len(self.lacking) < SEEN_KEYS:
            self.lacking[key] = (owner, tokens)

    def complete(self, key: str, blobs: Blobs) -> list[str]:
        """``blobs`` now hold both models' part: they replace the entry here and in the tier."""
        self.lacking.pop(key, None)
        self.completed += 1
        if self.tier is not None:
            self.tier.put(key, blobs, replace=True)
        return self.parked.put(key, blobs, spill=False)

    def finish(self, key: str, blobs: Blobs | None) -> list[str]:
        """The build ended: keep its state (None: it failed, the next turn builds it).
        Returns the parked sessions evicted to make room."""
        self._building.discard(key)
        if blobs is None:
            return []
        self.unfilled.pop(key, None)
        if self.tier is not None:
            self.tier.put(key, blobs)
        return self.parked.put(key, blobs, spill=False)
