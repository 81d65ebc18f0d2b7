"""How alike two scoring models choose: the kept sets of the default selection (lookahead 1,
the structural guard) on the planner bench's prompts, code and logs, and each capture's time.

    .venv/bin/python ops/kept_overlap.py SPEC_A.gguf SPEC_B.gguf 4000

Prints, per prompt, each model's kept count, the overlap (Jaccard) and the share of A's
kept tokens that B keeps too (results/planner.md, "Where the speculator's time goes").
"""

from __future__ import annotations

import sys

from bench.planner import prompt_doc
from core.config import EngineConfig
from core.engine import Engine
from core.policies import PrefillPolicy
from evals.answer_quality import Setting, capture, kept_for


def main() -> None:
    paths, n = sys.argv[1:3], int(sys.argv[3])
    engines = [Engine(EngineConfig(target=p, speculator=p, n_ctx=n + 512, calibrate_tokens=0, slots=1,
                                   scorer="speculator-full",  # each file scores as given
                                   attention_capture="flash")) for p in paths]
    policy = PrefillPolicy()
    try:
        for content in ("code", "logs"):
            doc = prompt_doc(content, n, 0)
            prompt = engines[0].chat.render_chat(doc["messages"], doc["tools"])
            guard = engines[0].plan(prompt, PrefillPolicy(min_tokens=0, break_even=False)).protected
            kept, secs = [], []
            for engine in engines:
                steps, s = capture(engine, prompt.tokens)
                kept.append(set(kept_for(steps, len(prompt), Setting("default", lookahead=1), policy, guard).tolist()))
                secs.append(s)
            both = len(kept[0] & kept[1])
            print(f"{content} {len(prompt)} tokens: kept {len(kept[0])} / {len(kept[1])}, "
                  f"overlap {both / len(kept[0] | kept[1]):.3f}, recall of A {both / len(kept[0]):.3f}; "
                  f"capture {secs[0]:.1f} s / {secs[1]:.1f} s", flush=True)
    finally:
        for engine in engines:
            engine.close()


if __name__ == "__main__":
    main()
