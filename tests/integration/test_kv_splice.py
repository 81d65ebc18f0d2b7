"""A run of saved KV cells moved to another position (core.kv.rope, core.llama.seq_cells,
SlotCells.splice), checked against llama.cpp's own K-shift on real models: NEOX (the Qwen-derived
tiny target) and NORM (SmolLM2) rotary layouts, V stored plain and transposed."""

from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest

from core.errors import EngineError
from core.kv.positions import SessionKV
from core.kv.slot_cells import SlotCells
from core.llama import seq_cells
from core.llama.context import Context
from core.llama.model import Model
from core.specprefill.cost_model import Costs
from tests.support import start_gateway, until

X = list(range(200, 240))  # a shared start
Z = list(range(900, 930))  # the run that moves
D = 17  # positions it moves by


@pytest.fixture(params=["tiny_target", "small_model"])
def model(request):
    m = Model(str(request.getfixturevalue(request.param)))
    yield m
    m.close()


@pytest.mark.parametrize("unified", [False, True], ids=["split", "unified"])
@pytest.mark.parametrize("flash_attn", [True, False], ids=["v-rows", "v-transposed"])
def test_a_moved_run_attends_as_llama_cpps_k_shift_makes_it(model, flash_attn, unified):
    """In a unified cache the run travels alone, through the scratch sequence (left empty),
    and the prefix stays shared; between split streams both sequences are saved whole."""
    ctx = Context(model, n_ctx=512, n_batch=128, n_ubatch=128, n_threads=2, flash_attn=flash_attn, n_seq=3,
                  unified=unified)
    try:
        kv = SlotCells(ctx, ctx, Costs(), lambda n: 1)
        src, ref, mine = ctx.seq(0), ctx.seq(1), ctx.seq(2)
        for seq in (src, ref):
            seq.decode(X + Z, 0, logits_last=False)
        mine.decode(X, 0, logits_last=False)
        moved = kv.splice(mine.id, src.id, len(X), len(X) + D, len(Z))
        assert moved > 0 and mine.pos_max() == len(X) + D + len(Z) - 1
        run_bytes = seq_cells.parse(src.save(), src.id).take(np.arange(len(Z)))
        assert moved == sum(x.nbytes for x in (*run_bytes.k, *run_bytes.v))  # the run's cells, no more
        if unified:
            assert ctx.scratch_seq >= 0 and ctx.seq_pos_max(ctx.scratch_seq) == -1
        cells = seq_cells.parse(mine.save(), mine.id)
        assert cells.v_trans is not flash_attn
        assert sorted(cells.positions.tolist()) == [*range(len(X)), *range(len(X) + D, len(X) + D + len(Z))]
        ref.shift_cells(len(X), len(X) + len(Z), D)  # llama.cpp re-rotates K on the next decode
        probe = len(X) + D + len(Z)
        ref.decode([42], probe)
        want = ref.logits().copy()
        mine.decode([42], probe)
        got = mine.logits().copy()
        assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
        # the labels moved without the rotation: the test would see it
        src.decode([42], len(X) + len(Z))
        stale = seq_cells.parse(src.save(), src.id)
        assert np.array_equal(np.sort(stale.positions), np.arange(len(X) + len(Z) + 1))
        mine.clear_cells()
        mine.decode(X, 0, logits_last=False)
        unrotated = seq_cells.parse(src.save(), src.id)
        run = unrotated.take(np.flatnonzero((unrotated.positions >= len(X)) & (unrotated.positions < probe - D)))
        base = seq_cells.parse(mine.save(), mine.id)
        mine.load_state(seq_cells.write(base.join(dataclasses.replace(
            run, positions=run.positions + D))))
        mine.decode([42], probe)
        assert np.abs(mine.logits() - want).max() > 0.05 * np.abs(want).max()
    finally:
        ctx.close()


@pytest.mark.parametrize("unified", [False, True], ids=["split", "unified"])
def test_a_run_the_donor_does_not_hold_whole_is_refused(tiny_target, unified):
    model = Model(str(tiny_target))
    ctx = Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2, flash_attn=True, n_seq=2,
                  unified=unified)
    try:
        kv = SlotCells(ctx, ctx, Costs(), lambda n: 1)
        ctx.seq(0).decode(X, 0, logits_last=False)
        ctx.seq(1).decode(X[:8], 0, logits_last=False)
        with pytest.raises(EngineError, match="every position"):
            kv.splice(1, 0, 30, 40, 20)  # positions 40..49 are not there
        assert ctx.seq(1).pos_max() == 7  # left as it was
        assert not unified or ctx.seq_pos_max(ctx.scratch_seq) == -1
    finally:
        ctx.close()
        model.close()


@pytest.mark.parametrize("unified", [False, True], ids=["split", "unified"])
def test_a_prefix_cut_from_a_resident_session_leaves_it_as_it_was(tiny_target, unified):
    """A shared prefix's entry, cut from an idle session in idle time: exactly the prefix's
    cells, which restore into another slot and continue as the session itself would."""
    model = Model(str(tiny_target))
    ctx = Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2, flash_attn=True, n_seq=2,
                  unified=unified)
    try:
        kv = SlotCells(ctx, ctx, Costs(), lambda n: 1)
        holder = SessionKV()
        ctx.seq(0).decode(X + Z, 0, logits_last=False)
        holder.target.extend(X + Z, range(len(X) + len(Z)))
        assert kv.cut_prefix(tuple(X), 0, holder, with_scorer=True) is None  # its scorer holds nothing
        assert kv.cut_prefix(tuple(X + [1]), 0, holder) is None  # not what it holds
        target, scorer = kv.cut_prefix(tuple(X), 0, holder)
        assert scorer == b"" and sorted(seq_cells.parse(target, seq_cells_id(target)).positions) == list(range(len(X)))
        assert ctx.seq(0).pos_max() == len(X) + len(Z) - 1
        assert not unified or ctx.seq_pos_max(ctx.scratch_seq) == -1
        ctx.seq(1).load_state(target)
        ctx.seq(1).decode(Z[:1], len(X))
        ctx.seq(0).remove_from(len(X) + 1)
        ctx.seq(0).decode(Z[1:2], len(X) + 1)  # the holder still continues from its own cells
        assert ctx.seq(1).pos_max() == len(X)
    finally:
        ctx.close()
        model.close()


def seq_cells_id(blob: bytes) -> int:
    """The sequence id a saved state was written from (its second word)."""
    return int(np.frombuffer(blob[4:8], dtype="<i4")[0])


SYSTEM = "You operate the plant. Units report flow, pressure and temperature every minute. " * 40
NOTE = ("Environment: working directory /srv/plant, a git repository on branch main; platform linux; "
        "the historian answers on port 8086; logs rotate daily at midnight UTC. ") * 12


def sibling_turn(base: str, sid: str, task: str, extra: list | None = None) -> dict:
    """Claude Code's layout: the system prompt, the user's task, then an environment note as a
    second system message (the same in every conversation)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task},
                {"role": "system", "content": NOTE}, *(extra or [])]
    r = httpx.post(base + "/v1/chat/completions", headers={"X-SpecGate-Session": sid}, timeout=120,
                   json={"messages": messages, "max_tokens": 4, "specprefill": False})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(("splice_min_tokens", "layout"), [(256, "split"), (256, "unified"), (0, "split")],
                         ids=["splice", "splice-unified", "off"])
def test_a_sibling_conversation_reuses_the_block_after_its_own_task(tiny_target, tiny_speculator,
                                                                    splice_min_tokens, layout):
    gw = start_gateway(tiny_target, tiny_speculator, engine={"slots": 2, "kv_layout": layout},
                       splice_min_tokens=splice_min_tokens)
    try:
        sibling_turn(gw.base, "s-1", "Say hello.")
        second = sibling_turn(gw.base, "s-2", "Which unit raised the last pressure alarm, and when exactly?")
        t = second["timings"]
        task_and_note = t["context_n"] - t["prefix_shared_n"] + t["prefix_spliced_n"]
        if not splice_min_tokens:  # the shared prefix ends at the task: the note is prefilled again
            assert t["prefix_spliced_n"] == 0 and t["prompt_n"] == t["context_n"] - t["cache_n"] >= 300
            return
        assert t["prefix_spliced_n"] >= 300 and t["prefix_source"] == "resident"
        assert t["prompt_n"] < 40 and t["cache_n"] + t["prompt_n"] == t["context_n"]  # the task and the tail
        assert t["cache_n"] / t["context_n"] > 0.95 and task_and_note > t["prefix_spliced_n"]
        assert second["choices"][0]["finish_reason"] in ("stop", "length")
        # the session's KV bookkeeping holds: its next turn reuses everything it has
        reply = second["choices"][0]["message"]["content"] or ""
        third = sibling_turn(gw.base, "s-2", "Which unit raised the last pressure alarm, and when exactly?",
                             [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}])
        assert third["timings"]["cache_n"] >= t["context_n"]
    finally:
        gw.stop()


def metric(base: str, name: str) -> float:
    line = next(x for x in httpx.get(base + "/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def keyed_turn(base: str, key: str, sid: str, task: str) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task},
                {"role": "system", "content": NOTE}]
    r = httpx.post(base + "/v1/chat/completions", timeout=120, json={"messages": messages, "max_tokens": 4,
                                                                      "specprefill": False},
                   headers={"X-SpecGate-Session": sid, "Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()["timings"]


def test_a_restarted_server_starts_a_sibling_from_another_conversations_checkpoint(tiny_target, tiny_speculator,
                                                                                    tmp_path):
    """After a restart (or on a replica sharing the tier) no idle session lends KV: the key's
    checkpointed conversation does, loaded into a free slot for the moment; its prefix is
    copied and the note after the task spliced, as from a resident sibling.  Another key's
    conversation with the same prompt gets nothing from it."""
    def gateway():
        return start_gateway(tiny_target, tiny_speculator, engine={"slots": 2}, kv_tier_dir=str(tmp_path),
                             kv_checkpoint_tokens=256, api_keys=("key-a", "key-b"))
    first = gateway()
    try:
        keyed_turn(first.base, "key-a", "c-1", "Say hello.")
        assert until(lambda: metric(first.base, "specgate_session_checkpoints_total") >= 1)
    finally:
        first.stop()
    again = gateway()
    try:
        task = "Which unit raised the last pressure alarm, and when exactly?"
        other = keyed_turn(again.base, "key-b", "c-2", task)
        assert other.get("prefix_source") != "conversation" and not other.get("prefix_spliced_n")
        assert metric(again.base, "specgate_checkpoints_lent_total") == 0
        t = keyed_turn(again.base, "key-a", "c-3", task)
        assert t["prefix_source"] == "conversation" and t["prefix_spliced_n"] >= 300, t
        assert t["prefix_bytes"] > 0 and t["cache_n"] / t["context_n"] > 0.95 and t["prompt_n"] < 40
        assert metric(again.base, "specgate_checkpoints_lent_total") == 1
        assert metric(again.base, "specgate_kv_spliced_tokens_total") == t["prefix_spliced_n"]
        # the lending slot was key-b's idle session's: parked first, emptied after; that session lost nothing
        assert metric(again.base, "specgate_slots_resident") == 1
        assert keyed_turn(again.base, "key-b", "c-2", task)["cache_n"] >= other["context_n"] - 1
    finally:
        again.stop()


def test_isolated_conversations_share_the_system_prompt_and_nothing_after_it(tiny_target, tiny_speculator):
    """``--isolate-conversations`` (many end users behind one key): a second conversation still
    starts from the first one's system prompt, but takes none of its turn -- no splice of the
    note it repeats after its own task, whose cells attended to the other user's task."""
    shared = {}
    for isolate in (False, True):
        gw = start_gateway(tiny_target, tiny_speculator, engine={"slots": 2}, splice_min_tokens=256,
                           isolate_conversations=isolate)
        try:
            sibling_turn(gw.base, "u-1", "Say hello.")
            t = sibling_turn(gw.base, "u-2", "Which unit raised the last pressure alarm, and when exactly?")["timings"]
            shared[isolate] = (t["prefix_shared_n"], t["prefix_spliced_n"])
        finally:
            gw.stop()
    (plain_shared, plain_spliced), (iso_shared, iso_spliced) = shared[False], shared[True]
    assert plain_spliced >= 300 and iso_spliced == 0
    system_only = plain_shared - plain_spliced  # the common prefix: the system prompt and the user turn's opening
    assert 0 < iso_shared <= system_only and system_only - iso_shared < 8
