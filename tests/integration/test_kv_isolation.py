"""One key's KV never reaches another key's session (issue 51, points 1 and 2).

Both tests drive real turns by hand on a real (tiny) engine, so the interleaving that
the step loop allows -- another key's turn seated between two chunks of a prefill, a
load into a slot before a queued stream copy from it has landed -- happens at a chosen
moment instead of by chance."""

from __future__ import annotations

import numpy as np
import pytest

from core.kv.positions import SessionKV
from core.llama import seq_cells
from core.runtime.residency import Residency
from core.runtime.seating import session_turn
from core.spans import common_prefix
from core.steps import Tokens
from core.turn_request import TurnRequest
from sessions.kv.parked import ParkedKV
from sessions.kv.prefixes import PrefixCache
from sessions.session import Session
from tests.support import engine_config, policy

SYSTEM = "You operate the plant. Units report flow, pressure and temperature every minute. " * 40
NOTE = ("Environment: working directory /srv/plant, a git repository on branch main; platform linux; "
        "the historian answers on port 8086; logs rotate daily at midnight UTC. ") * 12
OTHER = "Ledger entries for the northern warehouse list pallets, bins and carriers by the hour. " * 90
DENSE = policy(enabled=False, max_tokens=2)


@pytest.fixture(params=["split", "unified"])
def engine2(request, tiny_target, tiny_speculator):
    from core.engine import Engine

    engine = Engine(engine_config(tiny_target, tiny_speculator, slots=2, kv_layout=request.param))
    yield engine
    engine.close()


def work(owner: str, *messages: dict) -> TurnRequest:
    return TurnRequest(owner=owner, messages=tuple(messages), tools=None, params=DENSE)


def sibling(owner: str, task: str) -> TurnRequest:
    return work(owner, {"role": "system", "content": SYSTEM}, {"role": "user", "content": task},
                {"role": "system", "content": NOTE})


def run(turn, reply=None) -> object:
    """Drive ``turn`` to its result, each request decoded alone (``reply``: what to resume with)."""
    while True:
        try:
            req = turn.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = None
        if isinstance(req, Tokens):
            req.seq.decode(req.tokens, req.start_pos, logits_last=req.logits)
            reply = -1


def residency(splice_min_tokens: int = 0) -> Residency:
    parked = ParkedKV(1 << 30)
    return Residency(2, parked, PrefixCache(parked, 0), splice_min_tokens=splice_min_tokens)


def last_v(blob: bytes, seq_id: int, lo: int, hi: int) -> np.ndarray:
    """The last layer's V of the cells at positions [lo, hi), in position order (V is never
    rotated: a cell copied elsewhere keeps it byte for byte)."""
    cells = seq_cells.parse(blob, seq_id).at(lo, hi)
    v = cells.v[-1]
    return np.ascontiguousarray(v.transpose(1, 0, 2) if cells.v_trans else v)


def test_a_donor_slot_taken_by_another_key_mid_gap_lends_nothing(engine2):
    """A sibling conversation of key A finds the environment note in A's idle session (the
    donor) and prefills its own task before splicing the note in.  While that gap is
    prefilled, over two steps, key B's turn takes the donor's slot and loads B's KV there.
    The splice must not copy B's cells: it is skipped, and A's session holds only cells it
    computed or copied from A's own conversation."""
    res = residency(splice_min_tokens=64)
    b = Session(id="b", owner="key-b")
    b_first = work("key-b", {"role": "system", "content": OTHER}, {"role": "user", "content": "Count the bins."})
    run(session_turn(res, engine2, b, b_first))  # B in slot 0
    a1 = Session(id="a1", owner="key-a")
    run(session_turn(res, engine2, a1, sibling("key-a", "Say hello.")))  # A1 in slot 1: the donor
    donor_slot = res.slots.find(a1)
    a2 = Session(id="a2", owner="key-a")
    a2_turn = session_turn(res, engine2, a2, sibling("key-a", "Which unit raised the last pressure alarm, and when?"))
    b_turn = None
    try:
        gap = a2_turn.send(None)  # B parked, A2 seated in slot 0, the prefix adopted, the task's gap asked for
        assert isinstance(gap, Tokens) and gap.seq.id == res.slots.find(a2) != donor_slot
        assert len(gap.tokens) >= 4 and len(a2.kv.target.tokens) == gap.start_pos > 0
        half = len(gap.tokens) // 2
        gap.seq.decode(gap.tokens[:half], gap.start_pos, logits_last=False)  # the gap's first step

        # between the two steps, key B's next turn takes the donor's slot and loads its own KV there
        b_turn = session_turn(res, engine2, b, work("key-b", *b_first.messages, {"role": "assistant", "content": "Ok."},
                                                      {"role": "user", "content": "And the carriers?"}))
        b_req = b_turn.send(None)
        assert res.slots.find(b) == donor_slot and res.slots.find(a1) is None
        b_cells = engine2.target_ctx.seq(donor_slot).save()
        gap.seq.decode(gap.tokens[half:], gap.start_pos + half, logits_last=gap.logits)  # its second step
        next_req = a2_turn.send(-1)  # the splice, had the donor stayed

        spliced = len(a2.kv.target.tokens) - gap.start_pos - len(gap.tokens)
        mine = engine2.target_ctx.seq(res.slots.find(a2)).save()
        same = common_prefix(a2.kv.target.tokens, b.kv.target.tokens)  # the template's opening: alike in both
        theirs = {row.tobytes() for row in last_v(b_cells, donor_slot, same, 1 << 30)}
        assert not any(row.tobytes() in theirs for row in last_v(mine, res.slots.find(a2), same, 1 << 30)), \
            "key B's cells in key A's session"
        assert spliced == 0, "a splice from a slot that changed hands"
        assert res.spliced == 0
        # both turns still finish, each from its own KV
        reply = -1 if isinstance(next_req, Tokens) else None
        if isinstance(next_req, Tokens):
            next_req.seq.decode(next_req.tokens, next_req.start_pos, logits_last=next_req.logits)
        out = run(a2_turn, reply)
        assert out.result.timings.prefix_spliced_n == 0 and out.result.timings.prefix_shared_n > 0
        b_req.seq.decode(b_req.tokens, b_req.start_pos, logits_last=b_req.logits)
        assert run(b_turn, -1).result.timings.cache_n > 0
    finally:  # a suspended turn closed after its engine would touch freed contexts
        for turn in (a2_turn, b_turn):
            if turn is not None:
                turn.close()


@pytest.mark.parametrize("unified", [False, True], ids=["split", "unified"])
def test_an_adopted_prefix_is_the_donors_even_when_its_slot_is_reloaded_at_once(tiny_target, unified):
    """Between split KV streams llama.cpp only queues a sequence copy; it lands at the
    context's next decode.  Another key's KV loaded into the source slot before then (a
    parked session taking the slot in the same step) must not become the adopted prefix."""
    from core.kv.slot_cells import SlotCells
    from core.llama.context import Context
    from core.llama.model import Model
    from core.specprefill.cost_model import Costs

    model = Model(str(tiny_target))
    ctx = Context(model, n_ctx=512, n_batch=128, n_ubatch=128, n_threads=2, flash_attn=True, n_seq=3,
                  unified=unified)
    try:
        kv = SlotCells(ctx, ctx, Costs(), lambda n: 1)
        donor_tokens = list(range(300, 400))
        ctx.seq(0).decode(donor_tokens, 0, logits_last=False)
        ctx.seq(2).decode(list(range(1000, 1150)), 0, logits_last=False)  # another key's session
        others = ctx.seq(2).save()
        donor = SessionKV()
        donor.target.extend(donor_tokens, range(len(donor_tokens)))
        donor.speculator.extend(donor_tokens, range(len(donor_tokens)))
        before = ctx.seq(0).save()
        mine = SessionKV()
        assert kv.adopt_prefix(tuple(donor_tokens[:80]) + (7,), mine, 1, donor, 0) == 80
        ctx.seq(0).load_state(_as_seq(others, 2, 0))  # the source slot, reloaded
        adopted = ctx.seq(1).save()  # before any decode
        assert np.array_equal(last_v(adopted, 1, 0, 80), last_v(before, 0, 0, 80))
        ctx.seq(2).decode([5], 150)  # a decode of any slot: a copy still queued would land now
        assert np.array_equal(last_v(ctx.seq(1).save(), 1, 0, 80), last_v(before, 0, 0, 80))
    finally:
        ctx.close()
        model.close()


def _as_seq(blob: bytes, src: int, dst: int) -> bytes:
    """A saved sequence of slot ``src`` laid out to load into slot ``dst`` of the same context."""
    cells = seq_cells.parse(blob, src)
    return seq_cells.write(cells.of(dst, cells.n_stream, dst if cells.n_stream > 1 else 0))


def test_the_two_key_soak_sees_a_cell_of_the_other_keys_canary(tiny_target, tiny_speculator):
    """The soak's detector (bench/soak_keys.py) can fail: a slot of key A's session holding one
    run of key B's canary tokens is counted, and the same slot with A's own text is not."""
    from bench import soak_keys
    from core.engine import Engine

    engine = Engine(engine_config(tiny_target, tiny_speculator, slots=2))
    try:
        refs = soak_keys.canary_rows(engine)
        res = residency()
        owner_a = next(o for o, k in soak_keys.OWNERS.items() if k == "key-a")
        seat = res.slots.seat(Session(id="a", owner=owner_a))
        mine = engine.target.tokenize(soak_keys.system_prompt("key-a", None), add_special=False)
        engine.target_ctx.seq(seat.slot).decode(mine, 0, logits_last=False)
        assert soak_keys.cross_key_cells(engine, res, refs) == (0, 1)
        theirs = engine.target.tokenize(" " + soak_keys.KEYS["key-b"], add_special=False)
        engine.target_ctx.seq(seat.slot).decode(theirs, len(mine), logits_last=False)
        found, _ = soak_keys.cross_key_cells(engine, res, refs)
        assert found >= 3
    finally:
        engine.close()
