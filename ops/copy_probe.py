"""Why a kept function is not copied: one eval-depth question, the same history, the selection
changed by hand around the named block (issue 52).

    .venv/bin/python ops/copy_probe.py SEED[,SEED...] OUT_DIR [dense] [ARM ...]

For each seed, the eval's first question of its first tool result (a Read at ~13K depth, "copy
function X"): dense first (when named, or with no arm named), then each arm in a slot of its
own, adopting the same dense prefix, prefilled once for all seeds.  An arm is one of
evals.depth's POLICIES (``default``, ``focus``, ...) or a variant.  A variant rewrites the default selection's kept set
(core.engine's ``select_tokens``) before the target prefills it:

- ``default``: as served;
- ``block_only``: the guarded spans and the named lines and blocks, nothing else of the file;
- ``no_after``: the default without what it kept after the named block (the guarded spans aside);
- ``near``: the default with 12 lines either side of the named block;
- ``almost_all``: every token but one comment-free token far from the block (the sparse path's
  machinery with near-dense content).

Writes OUT_DIR/probe.json (replies, correctness, kept counts) and OUT_DIR/SEED/kept_<arm>.txt
(what the target saw of the tool result, dropped stretches as ``[... N]``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

import core.engine as engine_mod
from bench.common import write_result
from core.config import EngineConfig
from core.engine import Engine
from core.kv.positions import SessionKV
from core.models import model_files
from core.policies import PrefillPolicy, SamplingParams, Selection, TurnParams
from core.prompt import Prompt
from core.spans import runs
from core.specprefill.lines import Lines, named_with_blocks
from core.specprefill.selection import forced_mask
from core.steps import drive
from evals.agent_files import ToolResult, correct, tool_results
from evals.depth import POLICIES, Conversation, agent_prefix, gapped_text, max_tokens, prefix_end

Transform = Callable[[np.ndarray, np.ndarray, Lines], np.ndarray]  # kept mask, forced mask, lines -> kept mask


def _block(lines: Lines) -> tuple[int, int]:
    """The named def's line range: the stretch of named lines and blocks from the first named
    line that opens a block."""
    heads = np.flatnonzero(lines.named & lines.opens)
    if not heads.size:
        return 0, 0
    return next((a, b) for a, b in runs(np.flatnonzero(named_with_blocks(lines, 80, 96))) if a <= heads[0] < b)


def _block_only(kept: np.ndarray, forced: np.ndarray, lines: Lines) -> np.ndarray:
    return forced | named_with_blocks(lines, 80, 96)[lines.of_token]


def _no_after(kept: np.ndarray, forced: np.ndarray, lines: Lines) -> np.ndarray:
    _, end = _block(lines)
    return kept & ((lines.of_token < end) | forced)


def _near(kept: np.ndarray, forced: np.ndarray, lines: Lines) -> np.ndarray:
    a, b = _block(lines)
    return kept | ((lines.of_token >= a - 12) & (lines.of_token < b + 12))


def _almost_all(kept: np.ndarray, forced: np.ndarray, lines: Lines) -> np.ndarray:
    out = np.ones_like(kept)
    a, _ = _block(lines)
    far = np.flatnonzero(~forced & (lines.of_token > a + 60))
    out[far[len(far) // 2]] = False
    return out


VARIANTS: dict[str, Transform | None] = {"default": None, "block_only": _block_only, "no_after": _no_after,
                                          "near": _near, "almost_all": _almost_all}
STATE: dict[str, Any] = {"transform": None}
_select = engine_mod.select_tokens


def _patched(scores: np.ndarray, params: Selection, protected: Iterable[tuple[int, int]] = (),
             lines: Lines | None = None, code: bool = False) -> np.ndarray:
    idx = _select(scores, params, protected, lines, code)
    fn = STATE["transform"]
    if fn is None or lines is None:
        return idx
    kept = np.zeros(scores.size, dtype=bool)
    kept[idx] = True
    forced = forced_mask(scores.size, params.keep_first, params.keep_last, protected)
    return np.flatnonzero(fn(kept, forced, lines))


def main() -> None:
    seeds, out = [int(x) for x in sys.argv[1].split(",")], Path(sys.argv[2])
    asked = sys.argv[3:] or ["dense", *VARIANTS]
    arms = ("dense", *[n for n in asked if n != "dense"]) if "dense" in asked else tuple(asked)
    engine_mod.select_tokens = _patched
    config = model_files.with_default_models(EngineConfig(slots=1 + len(arms), n_ctx=18432))
    engine = Engine(config)
    try:
        system, tools = agent_prefix()
        ref = SessionKV()  # slot 0 holds the agent's prefix, shared by every seed
        rows = []
        for seed in seeds:
            conv = Conversation(engine, system, tools, arms)
            conv.slot = {arm: i + 1 for i, arm in enumerate(arms)}
            result = tool_results(seed, 1)[0]
            prompt = engine.chat.render_chat(conv.messages(result.questions[0], result), tools)
            if not ref.target.tokens:
                drive(engine.slot_cells.prefill_prefix(prompt.tokens[:prefix_end(prompt)], ref, 0))
            for arm in arms:
                for ctx in (engine.slot_cells.target_ctx, engine.slot_cells.speculator_ctx):
                    ctx.seq(conv.slot[arm]).clear_cells()
                engine.slot_cells.adopt_prefix(prompt.tokens, conv.kv[arm], conv.slot[arm], ref, 0)
            rows.append(probe(engine, conv, result, prompt, out / str(seed), seed))
        write_result(out / "probe.json", "copy_probe", {"seeds": seeds, "arms": arms, "rows": rows},
                     {"target": config.target, "speculator": config.speculator})
    finally:
        engine.close()


def probe(engine: Engine, conv: Conversation, result: ToolResult, prompt: Prompt, out: Path,
          seed: int) -> dict[str, Any]:
    """Each arm's reply to the tool result's first question, and what its target saw of the result."""
    out.mkdir(parents=True, exist_ok=True)
    q = result.questions[0]
    start = prefix_end(prompt)
    sampling = SamplingParams(max_tokens=max_tokens(q, engine), temperature=0.0)
    row: dict[str, Any] = {"seed": seed, "ask": q.ask, "answer": q.answer, "depth": len(prompt)}
    for arm in conv.arms:
        STATE["transform"] = VARIANTS.get(arm)
        res = engine.run(prompt, TurnParams(prefill=POLICIES.get(arm, PrefillPolicy()), sampling=sampling),
                         kv=conv.kv[arm], slot=conv.slot[arm])
        held = np.asarray(conv.kv[arm].target.kv_pos[start:len(prompt)]) >= 0
        t = res.timings
        row[arm] = {"correct": correct(q, res.text), "kept_pct": round(t.kept_pct, 1), "prompt_n": t.prompt_n,
                    "runs": t.kept_runs, "ttft_s": round(t.ttft_ms / 1e3, 1), "reply": res.text}
        (out / f"kept_{arm}.txt").write_text(gapped_text(engine, prompt.tokens[start:], held))
        print(seed, arm, orjson.dumps(row[arm]).decode()[:300], flush=True)
    return row


if __name__ == "__main__":
    main()
