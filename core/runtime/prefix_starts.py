"""How a session without KV starts: from a resident sibling's prefix, a cached system
prompt, its own checkpoint, or another conversation's checkpoint (model thread only).

Copying comes before computing.  The longest prefix an idle resident session of the same
owner holds densely is copied when it covers the system prompt (a sibling conversation, a
conversation's branch, another agent's history), and past it a run the donor repeats is
spliced in (core.kv.reuse).  Else the owner's checkpointed conversation in the KV tier
lends the same, or the owner's cached system prompt is restored, waited for while another
turn builds it, or built if it is frequent.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from core.errors import EngineError
from core.kv.positions import SessionKV, dense_prefix
from core.kv.reuse import find_run
from core.kv.stores import Holder
from core.prompt import Prompt
from core.results import PrefixStart
from core.runtime.residency import Residency
from core.steps import Tokens, TurnSteps, Wait

if TYPE_CHECKING:  # the engine runs on the model thread
    from core.engine import Engine

log = structlog.get_logger("specgate.sessions")
SPLICE_MAX_GAP = 1024  # new tokens (a task) prefilled before a spliced run, at most


def system_end(prompt: Prompt) -> int:
    """Where the prompt's leading system message (with the tools the template puts there)
    ends; 0 without one."""
    return prompt.spans[0].end if prompt.spans and prompt.spans[0].role == "system" else 0


def from_checkpoint(res: Residency, engine: Engine, session: Holder, prompt: Prompt, slot: int) -> PrefixStart:
    """A session being rebuilt (taken over, restarted, dropped under the budget) starts
    from its checkpoint in the KV tier when the prompt still begins with its tokens."""
    t0, checkpoints = time.perf_counter(), res.checkpoints
    found = checkpoints.find(session.key, session.owner, prompt.tokens) if checkpoints is not None else None
    if checkpoints is None or found is None:
        return PrefixStart()
    held, n, blobs = found
    if not engine.slot_cells.restore_prefix(blobs, prompt.tokens[:n], session.kv, slot, held):
        return PrefixStart()
    checkpoints.restored += 1
    log.info("session_restored_from_checkpoint", session_id=session.id, tokens=n, held=held)
    return PrefixStart(shared=n, seconds=time.perf_counter() - t0, source="checkpoint",
                       loaded_bytes=sum(map(len, blobs)))


def from_prefix(res: Residency, engine: Engine, owner: str, kv: SessionKV, prompt: Prompt,
                slot: int) -> TurnSteps[PrefixStart]:
    """Start ``kv`` (empty, in ``slot``) from a shared prefix (see the module's docstring)."""
    t0, n, prefixes = time.perf_counter(), res.prefixes.end(prompt), res.prefixes
    key = prefixes.key(owner, prompt.tokens[:n]) if n else ""
    shareable = prompt.tokens[:system_end(prompt) + 1] if res.isolate else prompt.tokens
    donor = _donor(res, owner, shareable)
    covered = n > 0 and donor is not None and donor[2] >= n
    if n and not covered and not res.isolate:
        lent = yield from _from_conversation(res, engine, owner, kv, prompt.tokens, slot, n)
        if lent is not None:
            lent.seconds = time.perf_counter() - t0
            return lent
    if covered or not n or not prefixes.wanted(key):
        if covered:
            prefixes.want(key, owner, prompt.tokens[:n])
        shared = _adopt(res, engine, kv, shareable, slot, donor)
        spliced, gap = 0, 0
        if shared and donor is not None:
            spliced, gap = yield from _splice(res, engine, kv, prompt.tokens, slot, donor[0], donor[1].kv,
                                              donor[1].id)
        return PrefixStart(shared=shared + spliced, seconds=time.perf_counter() - t0, source="resident",
                           spliced=spliced, gap=gap)
    if prefixes.building(key):
        prefixes.waits += 1
        yield Wait(lambda: not prefixes.building(key))
    blobs, evicted, source = prefixes.load(key)
    if blobs is not None:
        if engine.slot_cells.restore_prefix(blobs, prompt.tokens[:n], kv, slot):
            prefixes.note(key, owner, prompt.tokens[:n], blobs)
            prefixes.hits += 1
            return PrefixStart(shared=n, seconds=time.perf_counter() - t0, evicted=evicted, source=source,
                               loaded_bytes=sum(map(len, blobs)))
        prefixes.forget(key)
        log.warning("prefix_unloadable", tokens=n)
    prefixes.misses += 1
    prefixes.begin(key)
    built = None
    try:
        built = yield from engine.slot_cells.prefill_prefix(prompt.tokens[:n], kv, slot)
    finally:
        evicted += prefixes.finish(key, built)
    log.info("prefix_cached", tokens=n)
    return PrefixStart(built=n, seconds=time.perf_counter() - t0, evicted=evicted, source="built")


def _donor(res: Residency, owner: str, tokens: tuple[int, ...]) -> tuple[int, Holder, int] | None:
    """(slot, session, tokens) of the idle resident session of ``owner`` that holds the
    longest prefix of ``tokens`` densely (what can be copied as is)."""
    best: tuple[int, Holder, int] | None = None
    for donor_slot, holder in res.slots.idle():
        if isinstance(holder, Holder) and holder.owner == owner:
            n = dense_prefix(holder.kv.target, tokens)
            if n > (best[2] if best else 0):
                best = (donor_slot, holder, n)
    return best


def _from_conversation(res: Residency, engine: Engine, owner: str, kv: SessionKV, tokens: tuple[int, ...],
                       slot: int, n: int) -> TurnSteps[PrefixStart | None]:
    """No idle session here holds the prompt's system prompt (a replica that never saw this
    agent, a restart): the owner's checkpointed conversation in the KV tier that shares the
    most with the prompt is loaded into a free slot and lends its KV as a resident one would:
    its prefix, and a block repeated after a different task.  The slot is a free one, else
    the least recently used idle one, whose session is parked first.  None when no
    checkpoint gives more than the ``n``-token system prompt's own entry would, or every
    other slot runs a turn."""
    checkpoints, slots = res.checkpoints, res.slots
    if checkpoints is None or slots.busy >= len(slots):  # every other slot runs a turn
        return None
    best = checkpoints.best_lender(owner, tokens, n, res.splice_min_tokens, SPLICE_MAX_GAP)
    blobs = checkpoints.load(best[1]) if best is not None else None
    if best is None or blobs is None:
        return None
    lender_seat = object()  # holds the slot while the checkpoint lends from it
    seat = slots.seat(lender_seat)  # a free slot, else the least recently used idle one, parked
    lend, evicted = seat.slot, res.park(engine, seat)
    try:
        lender = SessionKV()
        if not engine.slot_cells.restore_prefix(blobs, best[0], lender, lend):
            log.warning("checkpoint_unloadable", tokens=len(best[0]))
            return PrefixStart(evicted=evicted)  # the turn prefills it all; the entry ages out
        shared = engine.slot_cells.adopt_prefix(tokens, kv, slot, lender, lend)
        # idle while the gap before a spliced run is prefilled: another turn may take it
        # (every running turn must find a slot), and the splice then finds it changed
        slots.release(lend)
        spliced, gap = yield from _splice(res, engine, kv, tokens, slot, lend, lender, "checkpoint")
    finally:
        if (mine := slots.find(lender_seat)) is not None:  # not taken meanwhile: emptied, freed
            engine.slot_cells.load(None, mine)
            slots.release(mine, keep=False)
    checkpoints.lent += 1
    log.info("prefix_lent_by_checkpoint", tokens=shared + spliced, spliced=spliced)
    return PrefixStart(shared=shared + spliced, source="conversation", loaded_bytes=sum(map(len, blobs)),
                       spliced=spliced, gap=gap, evicted=evicted)


def _splice(res: Residency, engine: Engine, kv: SessionKV, tokens: tuple[int, ...], slot: int,
            donor_slot: int, donor: SessionKV, donor_id: str) -> TurnSteps[tuple[int, int]]:
    """Past the adopted prefix, a run the donor holds further on (a sibling conversation's
    repeated block after its own task, core.kv.reuse) is moved into this prompt's place in
    the target: the tokens before it are prefilled first, then its cells spliced in
    (SlotCells.splice).  The scorer is left behind there, to catch up later.  Returns
    (tokens spliced, tokens prefilled before them)."""
    if not res.splice_min_tokens:
        return 0, 0
    start = len(kv.target.tokens)
    found = find_run(tokens[:-1], start, donor.target.tokens, donor.target.kv_pos, res.splice_min_tokens,
                     SPLICE_MAX_GAP)
    if found is None or found[0] + found[2] >= engine.kv_window:  # cells go at logical positions: inside the window
        return 0, 0
    k, j, n = found
    if k > start:
        stamp = res.slots.stamp(donor_slot)
        yield Tokens(engine.target_ctx.seq(slot), tokens[start:k], start, logits=False)
        kv.target.extend(tokens[start:k], range(start, k))
        if not res.slots.unchanged(donor_slot, stamp):  # other turns ran: it may hold another key's KV
            res.splices_skipped += 1
            log.info("kv_splice_skipped", donor=donor_id, reason="the donor's slot changed during the gap")
            return 0, k - start
    try:
        engine.slot_cells.splice(slot, donor_slot, j, k, n)
    except EngineError as exc:  # a model whose K cannot be moved, an unexpected state layout
        log.warning("kv_splice_failed", error=str(exc))
        return 0, k - start
    kv.target.extend(tokens[k:k + n], range(k, k + n))
    res.spliced += n
    log.info("kv_spliced", donor=donor_id, tokens=n, moved_by=k - j, prefilled_before=k - start)
    return n, k - start


def _adopt(res: Residency, engine: Engine, kv: SessionKV, tokens: tuple[int, ...], slot: int,
           donor: tuple[int, Holder, int] | None) -> int:
    if donor is None:
        return 0
    donor_slot, holder, _ = donor
    shared = engine.slot_cells.adopt_prefix(tokens, kv, slot, holder.kv, donor_slot)
    if shared:
        res.prefixes.adopted += 1
        log.info("session_prefix_shared", session_id=holder.id, tokens=shared, donor_slot=donor_slot)
    return shared
