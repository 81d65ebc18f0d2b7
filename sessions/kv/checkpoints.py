"""Session checkpoints in the KV tier: a session's KV, written in idle time, that another
replica (or this one after a restart) restores when it takes the session over, instead of
prefilling the whole conversation again.

A checkpoint is an ordinary tier entry named by its exact tokens (sessions.kv.prefixes.key:
the owner and the tokens), so it is only ever restored into a prompt that starts with those
very tokens, and it serves any conversation of that owner that does.  A small index file per
session says which entry is its latest: its tokens and key.  A prompt whose tokens part from
the checkpoint's before its end (a reply that renders back as other tokens than were
generated) restores the part they share.  The index is written after
the entry has landed, so a reader never follows it to a missing file (a stale index points to
an older entry, which is still a prefix of the conversation, or to one evicted by the tier's
budget: then the session rebuilds, as it did without a tier).  Both live under the tier's
folder, so replicas that share it share checkpoints.

A note per owner lists its latest checkpoints, newest first (``OWNER_RECENT``): a new
conversation of that owner on a replica or after a restart, which no session of this process
can lend KV to, starts from the one that shares the most with it (core.runtime.prefix_starts: its prefix, and a
block it repeats after a different task).  Replicas that write it at once may lose an entry:
it is a hint, and a lost entry costs a prefill, never a wrong state.  Model thread for what reads the KV;
files on the tier's writer thread.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from core.kv.reuse import PROBE, find_run
from core.spans import common_prefix
from sessions.kv.parked import Blobs
from sessions.kv.prefixes import PrefixCache
from sessions.kv.tier import KVTier

OWNER_RECENT = 8  # checkpoints an owner's note lists


class SessionCheckpoints:
    def __init__(self, tier: KVTier, min_new_tokens: int = 1024) -> None:
        self.tier = tier
        self.min_new = min_new_tokens  # a session is checkpointed again once it holds this many more tokens
        self._done: dict[str, int] = {}  # session key -> tokens in its last checkpoint (this process)
        self._live: dict[str, object] = {}  # session key -> a token its queued index writes must still find
        self.written = self.restored = 0
        self.lent = 0  # new conversations started from another conversation's checkpoint

    @staticmethod
    def _index(session_key: str) -> str:
        return f"session-{hashlib.sha256(session_key.encode()).hexdigest()[:40]}.json"

    @staticmethod
    def _owner_note(owner: str) -> str:
        return f"owner-{hashlib.sha256(owner.encode()).hexdigest()[:40]}.json"

    def due(self, session_key: str, n: int) -> bool:
        return n - self._done.get(session_key, 0) >= self.min_new

    def write(self, session_key: str, owner: str, tokens: Sequence[int], blobs: Blobs) -> bool:
        """Keep ``blobs`` (the KV of exactly ``tokens``) as the session's checkpoint; the files
        are written off the model thread.  False when the tier skipped it (its queue full)."""
        n, key = len(tokens), PrefixCache.key(owner, tokens)
        live = self._live.setdefault(session_key, object())
        if not self.tier.put(key, blobs, then=lambda: self._write_index(session_key, owner, tuple(tokens), key, live)):
            return False
        self._done[session_key] = n
        return True

    def _write_index(self, session_key: str, owner: str, tokens: tuple[int, ...], key: str, live: object) -> None:
        """Point the session at its new entry, and drop the entry it replaces (a conversation's
        checkpoints grow by a turn each: only the latest is worth its bytes); list it first
        in the owner's note.  A session deleted since the write was queued gets no index: its
        entry goes instead (writer thread)."""
        if self._live.get(session_key) is not live:
            self.tier.drop(key)
            return
        name = self._index(session_key)
        old = self._read(name, self.tier.read_note)
        self.tier.write_note(name, orjson.dumps({"tokens": tokens, "key": key}))
        self.written += 1
        if old is not None and old[1] != key:
            self.tier.drop(old[1])
        recent = [e for e in self._owner_entries(owner, self.tier.read_note) if e["session"] != name]
        entry = {"session": name, "tokens": tokens, "key": key}
        self.tier.write_note(self._owner_note(owner), orjson.dumps([entry, *recent][:OWNER_RECENT]))

    def _owner_entries(self, owner: str, read: Callable[[str], bytes | None]) -> list[dict[str, Any]]:
        try:
            entries = orjson.loads(read(self._owner_note(owner)) or b"[]")
            return [e for e in entries if isinstance(e, dict) and {"session", "tokens", "key"} <= set(e)]
        except (ValueError, TypeError):
            return []

    def recent(self, owner: str) -> list[tuple[tuple[int, ...], str]]:
        """(tokens, entry key) of the owner's latest checkpoints, newest first (each checked
        to be the owner's: an entry key is the owner and the tokens)."""
        out = []
        for e in self._owner_entries(owner, self.tier.note):
            try:
                tokens = tuple(int(t) for t in e["tokens"])
            except (TypeError, ValueError):
                continue
            if PrefixCache.key(owner, tokens) == e["key"]:
                out.append((tokens, str(e["key"])))
        return out

    @staticmethod
    def _read(name: str, read: Callable[[str], bytes | None]) -> tuple[tuple[int, ...], str] | None:
        try:
            index = orjson.loads(read(name) or b"")
            return tuple(int(t) for t in index["tokens"]), str(index["key"])
        except (ValueError, KeyError, TypeError):
            return None

    def find(self, session_key: str, owner: str, tokens: Sequence[int],
             min_tokens: int = 32) -> tuple[int, int, Blobs] | None:
        """The session's checkpoint when it shares at least ``min_tokens`` leading tokens with
        ``tokens`` and leaves some to prefill: (tokens it holds, tokens shared, its blobs);
        None otherwise (none, another key's, another conversation, or gone)."""
        if (index := self._read(self._index(session_key), self.tier.note)) is None:
            return None
        held, key = index
        if PrefixCache.key(owner, held) != key:  # written for another key (or tampered with)
            return None
        shared = common_prefix(held, tokens)
        if shared < min_tokens or shared >= len(tokens):
            return None
        blobs = self.tier.get(key)
        return (len(held), shared, blobs) if blobs is not None else None

    def forget(self, session_key: str, owner: str) -> None:
        """The session was deleted: its entry, its index and its line in the owner's note go,
        on the writer thread after whatever was queued for it (an index write queued before
        the delete finds the session gone and drops its entry instead)."""
        self._done.pop(session_key, None)
        self._live.pop(session_key, None)
        self.tier.submit(lambda: self._forget_files(session_key, owner))

    def _forget_files(self, session_key: str, owner: str) -> None:
        name = self._index(session_key)
        if (index := self._read(name, self.tier.read_note)) is not None:
            self.tier.drop(index[1])
        self.tier.delete_note(name)
        entries = self._owner_entries(owner, self.tier.read_note)
        if kept := [e for e in entries if e["session"] != name]:
            if len(kept) != len(entries):
                self.tier.write_note(self._owner_note(owner), orjson.dumps(kept))
        else:
            self.tier.delete_note(self._owner_note(owner))

    def load(self, key: str) -> Blobs | None:
        """The checkpoint entry ``key`` (a ``best_lender`` answer) from the tier."""
        return self.tier.get(key)

    def best_lender(self, owner: str, tokens: Sequence[int], n: int, min_run: int,
                    max_gap: int) -> tuple[tuple[int, ...], str] | None:
        """(tokens, entry key) of the owner's checkpoint that lends the most to ``tokens``: the
        prefix it shares, if that covers the ``n``-token system prompt, and the run a splice
        would move (core.kv.reuse; ``min_run`` 0: none).  None when none gives more than the
        system prompt's own cache entry would."""
        best, most = None, n + PROBE
        for held, key in self.recent(owner):
            shared = min(common_prefix(held, tokens), len(tokens) - 1)
            if shared < n:
                continue
            run = find_run(tokens[:-1], shared, held, range(len(held)), min_run, max_gap) if min_run else None
            if (gain := shared + (run[2] if run else 0)) > most:
                best, most = (held, key), gain
        return best
