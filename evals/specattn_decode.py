"""Decode speed of speculative decoding, dense against SpecAttn sparse verification.

One long real document (Python's argparse.py) is cut to the context length and
asked about once; the prompt is prefilled once into a session, and each arm
then decodes the same reply from that state (the session rolls both caches
back to the prompt between arms), so arms differ only in how they decode.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from bench.common import progress
from core import corpus
from core.config import EngineConfig
from core.engine import Engine
from core.kv.positions import SessionKV
from core.llama.context import VIEW_SEQ
from core.policies import DecodingPolicy, PrefillPolicy, SamplingParams, TurnParams

DOCUMENT = "stdlib:argparse.py"
QUESTION = "\n\nExplain what the code above does, step by step."


@dataclass(slots=True, frozen=True)
class DecodeSetup:
    contexts: tuple[int, ...]
    n_predict: int
    ps: tuple[float, ...]
    gamma: int


def arms(setup: DecodeSetup) -> list[tuple[str, DecodingPolicy]]:
    out = [("plain", DecodingPolicy(gamma=setup.gamma)),
           ("speculative", DecodingPolicy(gamma=setup.gamma, speculative=True))]
    out += [(f"specattn_p{p}", DecodingPolicy(gamma=setup.gamma, specattn=True, specattn_p=p)) for p in setup.ps]
    return out


def turn(decoding: DecodingPolicy, max_tokens: int) -> TurnParams:
    return TurnParams(PrefillPolicy(enabled=False), decoding, SamplingParams(max_tokens=max_tokens))


def prompt_of(engine: Engine, n_ctx: int) -> Any:
    text = corpus.read(DOCUMENT)
    budget = n_ctx - 48
    doc = engine.target.detokenize(engine.target.tokenize(text, add_special=False)[:budget])
    return engine.chat.render([{"role": "user", "content": doc + QUESTION}])


def _best_ms(fn: Callable[[], None], reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def step_costs(engine: Engine, kv: SessionKV, gamma: int) -> dict[str, float]:
    """One decode step of each model, and one verify batch dense and through views of
    5% and 20% of the cells (sinks + evenly spread 16-cell pages), at this context."""
    tctx, dctx, capture = engine.target_ctx, engine.speculator_ctx, engine.capture
    nt, nd, tok = kv.target.next_pos, kv.speculator.next_pos, kv.target.tokens[-1]

    def target(n: int, spans: list[tuple[int, int]] | None = None) -> None:
        if spans is not None:
            tctx.seq().make_view(spans)
        tctx.decode([tok] * n, nt, logits_all=True, seqs=(VIEW_SEQ,) if spans is not None else (0,))
        tctx.seq().drop_view()
        tctx.seq().remove_from(nt)

    def draft(with_capture: bool) -> None:
        if with_capture:
            capture.start(nd + 1)
        dctx.decode([tok], nd)
        if with_capture:
            capture.stop()
        dctx.seq().remove_from(nd)

    out = {"target_step": _best_ms(lambda: target(1)), "draft_step": _best_ms(lambda: draft(False)),
           "draft_step_capture": _best_ms(lambda: draft(True)), "verify_dense": _best_ms(lambda: target(gamma + 1))}
    for frac in (0.05, 0.2):
        stride = int(16 / frac)
        spans = [(0, 4)] + [(p, p + 16) for p in range(stride, nt - 16, stride)] + [(nt - 1, nt)]
        out[f"verify_view_{int(frac * 100)}pct"] = _best_ms(partial(target, gamma + 1, spans))
    return out


def at_context(target: str, speculator: str, n_ctx: int, setup: DecodeSetup) -> dict[str, Any]:
    engine = Engine(EngineConfig(target=target, speculator=speculator, n_ctx=n_ctx + setup.n_predict * 2 + 64,
                                 calibrate_tokens=0, scorer="speculator-full"))
    try:
        prompt = prompt_of(engine, n_ctx)
        kv = SessionKV()
        engine.slot_cells.load(None)
        warm = engine.run(prompt, turn(arms(setup)[1][1], 1), kv=kv)  # prefill both models
        progress(f"  {len(prompt)} tokens: target prefill {warm.timings.prompt_ms / 1e3:.1f} s, "
                 f"draft catch-up {warm.timings.draft_sync_ms / 1e3:.1f} s")
        rows = []
        for name, policy in arms(setup):
            r = engine.run(prompt, turn(policy, setup.n_predict), kv=kv)
            t, s = r.timings, r.timings.speculative
            rows.append({"arm": name, "n_predicted": t.predicted_n, "decode_ms": t.predicted_ms,
                         "tokens_per_s": t.predicted_n / (t.predicted_ms / 1e3), "accept_rate": s.accept_rate,
                         "n_rounds": s.n_rounds, "n_drafted": s.n_drafted, "n_accepted": s.n_accepted,
                         "kv_selected_frac": s.selected_frac, "kv_cells_attended": s.cells_attended,
                         "kv_cells_total": s.cells_total, "draft_ms": s.draft_s * 1e3, "verify_ms": s.verify_s * 1e3,
                         "text": r.text})
            progress(f"  {name}: {rows[-1]['tokens_per_s']:.2f} tok/s, acceptance {s.accept_rate:.2f}, "
                     f"KV selected {s.selected_frac:.3f}")
        costs = step_costs(engine, kv, setup.gamma)
        progress("  step costs (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()))
        return {"n_ctx": n_ctx, "n_prompt": len(prompt), "step_ms": costs, "prefill_s": warm.timings.prompt_ms / 1e3,
                "draft_sync_s": warm.timings.draft_sync_ms / 1e3, "layer_map": engine.layer_map.source,
                "rows": rows}
    finally:
        engine.close()
