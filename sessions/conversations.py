"""Which held conversation a request without a session id continues: an index over
token blocks (a hash chain, as prefix-caching engines keep).

Agent frameworks resend the whole conversation and name no session.  Each implicit
session's held tokens (its last prompt and reply) are cut into blocks of ``block``
tokens, and block ``i`` is filed under the hash of the owner and blocks ``0..i``.  A
prompt is looked up by walking its own chain: the lookup costs one dict probe per
block of the prompt, however many conversations are held, and it stops at the
first block nobody holds.  Hashes only nominate: the caller confirms a candidate
on its tokens before reusing it (:class:`ImplicitSessions`).  Owners are part of every
hash, so one API key never finds another's conversation.  Pure Python, no model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from core.spans import common_prefix
from sessions.session import Session, SessionState

BLOCK = 16  # tokens per block: a held conversation shorter than one is not found


def chain(owner: str, tokens: Sequence[int], block: int = BLOCK) -> list[bytes]:
    """The hash of every whole block of ``tokens``, each covering all blocks before it."""
    data = np.asarray(tokens[: len(tokens) // block * block], dtype="<i4").tobytes()
    h = hashlib.blake2b(owner.encode(), digest_size=16).digest()
    out = []
    step = 4 * block
    for i in range(0, len(data), step):
        h = hashlib.blake2b(h + data[i:i + step], digest_size=16).digest()
        out.append(h)
    return out


class ConversationIndex:
    def __init__(self, block: int = BLOCK) -> None:
        if block < 1:
            raise ValueError("block must be >= 1")
        self.block = block
        self._holders: dict[bytes, set[str]] = {}  # chain hash -> session keys holding that prefix
        self._chains: dict[str, list[bytes]] = {}  # session key -> its chain

    def __len__(self) -> int:
        return len(self._chains)

    def put(self, key: str, owner: str, tokens: Sequence[int]) -> None:
        """``key`` now holds ``tokens`` (replacing what it held)."""
        self.remove(key)
        hashes = chain(owner, tokens, self.block)
        if not hashes:
            return
        self._chains[key] = hashes
        for h in hashes:
            self._holders.setdefault(h, set()).add(key)

    def remove(self, key: str) -> None:
        for h in self._chains.pop(key, ()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self._holders[h]

    def lookup(self, owner: str, tokens: Sequence[int]) -> list[tuple[str, int]]:
        """``(key, tokens matched to a whole block)`` of every holder sharing at least one
        block with ``tokens``, longest first."""
        depth: dict[str, int] = {}
        for i, h in enumerate(chain(owner, tokens, self.block)):
            holders = self._holders.get(h)
            if not holders:
                break
            for key in holders:
                depth[key] = (i + 1) * self.block
        return sorted(depth.items(), key=lambda kv: -kv[1])


class ImplicitSessions:
    """Sessions the server made for requests that name none, found again by their tokens
    (event loop only).  The manager owns the sessions; this holds their index and figures."""

    def __init__(self, min_share: float = 0.5, block: int = BLOCK) -> None:
        self.index = ConversationIndex(block)
        self.min_share = min_share  # a match must cover this share of the prompt
        self.hits = self.misses = self.reused = 0  # reused: target tokens their turns found cached

    def continuing(self, sessions: Mapping[str, Session], owner: str, tokens: Sequence[int],
                   hint: str | None = None) -> Session | None:
        """The idle implicit session of ``owner`` that ``tokens`` continue: they repeat its
        whole last prompt (a branch of it forks instead) and its held tokens cover at least
        ``min_share`` of them.  A busy holder is passed over, never waited for.  A ``hint``
        (the client's prompt_cache_key or user) narrows the candidates to the conversations
        made under it; it never makes tokens that differ match."""
        for key, _ in self.index.lookup(owner, tokens):
            s = sessions.get(key)
            if s is None or s.state is not SessionState.IDLE or s.owner != owner or hint not in (None, s.hint):
                continue
            if common_prefix(s.kv.target.tokens, tokens) >= max(s.last_prompt_n, self.min_share * len(tokens)):
                self.hits += 1
                return s
        self.misses += 1
        return None

    def held(self, session: Session) -> None:
        """File what ``session`` holds now (after its turn), or drop it from the index."""
        if session.implicit and session.state is not SessionState.DELETED and session.kv.target.tokens:
            self.index.put(session.key, session.owner, session.kv.target.tokens)
        else:
            self.index.remove(session.key)

    def remove(self, key: str) -> None:
        self.index.remove(key)

    @staticmethod
    def victim(sessions: Iterable[Session], owner: str | None) -> Session | None:
        """The least recently used idle implicit session (of ``owner``; None: of anyone)."""
        idle = [s for s in sessions if s.implicit and s.state is SessionState.IDLE
                and (owner is None or s.owner == owner)]
        return min(idle, key=lambda s: s.last_active) if idle else None
