"""Speculative decoding's draft acceptance with each whole-speculator scorer: the
speculator as fetched and its Q4_0 copy (the default), on the real pair, greedy.

    .venv/bin/python ops/draft_acceptance.py [MAX_TOKENS] > results/bench/draft_acceptance.json

One prompt, one run per scorer; both must give the same tokens (greedy verification is
exact), so only the acceptance and the speed may differ.
"""

from __future__ import annotations

import sys

import orjson

from core.config import EngineConfig
from core.engine import Engine
from core.loader import override
from core.models import model_files
from core.policies import TurnParams

TASK = [{"role": "user", "content": "Write a Python function that parses an ISO 8601 date string and returns "
                                    "a datetime, with error handling and a docstring."}]


def main() -> None:
    max_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 96
    params = override(TurnParams(), enabled=False, speculative=True, max_tokens=max_tokens)
    out, tokens = [], set()
    for scorer in ("speculator-full", "speculator-q4_0"):
        engine = Engine(model_files.with_default_models(EngineConfig(n_ctx=1024, slots=1, calibrate_tokens=0,
                                                                     scorer=scorer)))
        try:
            r = engine.run(engine.chat.render(TASK), params)
        finally:
            engine.close()
        s, t = r.timings.speculative, r.timings.to_json()
        tokens.add(tuple(r.tokens))
        out.append({"scorer": scorer, "accept_rate": round(s.accept_rate, 3), "drafted": s.n_drafted,
                    "accepted": s.n_accepted, "rounds": s.n_rounds, "tokens": len(r.tokens),
                    "decode_tokens_per_s": t.get("predicted_per_second")})
    print(orjson.dumps({"max_tokens": max_tokens, "same_tokens": len(tokens) == 1, "runs": out},
                       option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
