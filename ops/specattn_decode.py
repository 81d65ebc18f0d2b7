"""Decode speed of speculative decoding, dense against SpecAttn sparse verification.

One long real document (Python's argparse.py) is cut to the context length and
asked about once; the prompt is prefilled once into a session, and each arm
then decodes the same reply from that state (the session rolls both caches
back to the prompt between arms), so arms differ only in how they decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.config import EngineConfig, PolicyConfig, SamplingParams
from core.engine import Engine
from core.kv_state import SessionKV
from ops import corpus
from ops.bench_common import progress

DOCUMENT = "stdlib:argparse.py"
QUESTION = "\n\nExplain what the code above does, step by step."


@dataclass(slots=True, frozen=True)
class DecodeSetup:
    contexts: tuple[int, ...]
    n_predict: int
    ps: tuple[float, ...]
    gamma: int


def arms(setup: DecodeSetup) -> list[tuple[str, PolicyConfig]]:
    base = PolicyConfig(enabled=False, gamma=setup.gamma)
    out = [("plain", base), ("speculative", PolicyConfig(enabled=False, gamma=setup.gamma, speculative=True))]
    out += [(f"specattn_p{p}", PolicyConfig(enabled=False, gamma=setup.gamma, specattn=True, specattn_p=p))
            for p in setup.ps]
    return out


def prompt_of(engine: Engine, n_ctx: int) -> Any:
    text = corpus.read(DOCUMENT)
    budget = n_ctx - 48
    doc = engine.target.detokenize(engine.target.tokenize(text, add_special=False)[:budget])
    return engine.chat.render([{"role": "user", "content": doc + QUESTION}])


def at_context(target: str, speculator: str, n_ctx: int, setup: DecodeSetup) -> dict[str, Any]:
    engine = Engine(EngineConfig(target=target, speculator=speculator, n_ctx=n_ctx + setup.n_predict * 2 + 64,
                                 calibrate_tokens=0))
    try:
        prompt = prompt_of(engine, n_ctx)
        kv = SessionKV()
        engine.load_kv(None)
        warm = engine.run(prompt, arms(setup)[1][1], SamplingParams(max_tokens=1), kv=kv)  # prefill both models
        progress(f"  {len(prompt)} tokens: target prefill {warm.timings.prefill_ms / 1e3:.1f} s, "
                 f"draft catch-up {warm.timings.draft_sync_ms / 1e3:.1f} s")
        rows = []
        for name, policy in arms(setup):
            r = engine.run(prompt, policy, SamplingParams(max_tokens=setup.n_predict), kv=kv)
            t = r.timings
            rows.append({"arm": name, "n_predicted": t.n_predicted, "decode_ms": t.decode_ms,
                         "tokens_per_s": t.n_predicted / (t.decode_ms / 1e3), "accept_rate": t.accept_rate,
                         "n_drafted": t.n_drafted, "n_accepted": t.n_accepted,
                         "kv_selected_frac": t.kv_selected_frac, "kv_cells_attended": t.kv_cells_attended,
                         "kv_cells_total": t.kv_cells_total, "text": r.text})
            progress(f"  {name}: {rows[-1]['tokens_per_s']:.2f} tok/s, acceptance {t.accept_rate:.2f}, "
                     f"KV selected {t.kv_selected_frac:.3f}")
        return {"n_ctx": n_ctx, "n_prompt": len(prompt), "prefill_s": warm.timings.prefill_ms / 1e3,
                "draft_sync_s": warm.timings.draft_sync_ms / 1e3, "layer_map": engine.layer_map.source,
                "rows": rows}
    finally:
        engine.close()
