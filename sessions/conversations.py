"""Which held conversation a request without a session id continues: an index over
token blocks (a hash chain, as prefix-caching engines keep).

Agent frameworks resend the whole conversation and name no session.  Each implicit
session's held tokens (its last prompt and reply) are cut into blocks of ``block``
tokens, and block ``i`` is filed under the hash of the owner and blocks ``0..i``.  A
prompt is looked up by walking its own chain: the lookup costs one dict probe per
block of the prompt, however many conversations are held, and it stops at the
first block nobody holds.  Hashes only nominate: the caller confirms a candidate
on its tokens before reusing it.  Owners are part of every hash, so one API key
never finds another's conversation.  Pure Python, no model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

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
