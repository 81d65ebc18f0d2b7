"""``specgate eval``: argument definitions (light) and dispatch; the evaluations
themselves import only when they run."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from core import corpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--per-family", type=int, default=5, help="tasks per family (5 families)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--words", type=int, default=800, help="filler words per task (~1.14 tokens each)")
    parser.add_argument("--quick", action="store_true", help="1 task per family and a small grid")
    parser.add_argument("--truncated", default="6,12", help="layer-truncated scorers to test (blocks), '' for none")
    parser.add_argument("--scorers", default="", help="cheaper scorers, e.g. S8,S12,T9,T14: the speculator's (S) "
                        "or the target's (T) first k blocks, with the guide's and the filter layer's aggregation; "
                        "q4_0: the whole speculator re-quantized to Q4_0")
    parser.add_argument("--only-scorers", action="store_true", help="run the cheaper-scorer arms only")
    parser.add_argument("--captures", default="", help="compare attention captures instead, e.g. flash,softmax: "
                        "the default scorer read through each (the first is the engine's own)")
    parser.add_argument("--out", default="results/eval")
    d = parser.add_argument_group("--depth")
    d.add_argument("--depth", action="store_true", help="SpecPrefill at depth on agent-shaped tool turns: answers "
                   "that must be copied, and retention against dense (evals/depth.py)")
    d.add_argument("--max-depth", type=int, default=28672, help="tokens the conversation grows to")
    d.add_argument("--idle-s", type=float, default=30.0, help="idle time between turns for the scorer to catch up")
    d.add_argument("--depth-seed", type=int, default=None, help="the tasks' seed (default: a fresh one each run)")
    d.add_argument("--depth-arms", default="dense,default", help="dense first, then SpecPrefill settings among "
                   "default, chunks (scored chunks alone), lines (whole lines kept), "
                   "blocks (whole lines and code blocks), skeleton (blocks and the "
                   "code's skeleton), named (whole lines and the request's named lines), copy (whole lines, skeleton "
                   "and named lines)")
    g = parser.add_argument_group("--specattn")
    g.add_argument("--specattn", action="store_true", help="SpecAttn: perplexity vs KV access, and decode speed")
    g.add_argument("--ppl-texts", default=",".join(corpus.EVALUATION), help="documents scored for perplexity")
    g.add_argument("--ppl-tokens", type=int, default=2048, help="tokens per document (first 10%% prefilled)")
    g.add_argument("--ps", default="0.95,0.97,0.99", help="SpecAttn top-p values")
    g.add_argument("--contexts", default="4096,16384", help="decode-speed context lengths ('' to skip)")
    g.add_argument("--decode-tokens", type=int, default=64)
    g.add_argument("--gamma", type=int, default=4)


def run(args: argparse.Namespace) -> int:
    import orjson

    if args.depth:
        from evals import depth
        out = Path(args.out) / "depth.json" if args.out != "results/eval" else Path("results/eval_depth/depth.json")
        summary = depth.run_depth(args.depth_seed, args.max_depth, args.idle_s, out, args.quick,
                                  tuple(args.depth_arms.split(",")))
        print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
        return 0
    if args.specattn:
        from evals import specattn
        print(orjson.dumps(specattn.run_specattn(args), option=orjson.OPT_INDENT_2).decode())
        return 0
    from evals import answer_quality

    per_family = 1 if args.quick else args.per_family
    truncated = tuple(int(x) for x in args.truncated.split(",") if x)
    early = tuple(x.strip() for x in args.scorers.split(",") if x.strip())
    if bad := [x for x in early if not re.fullmatch(r"q4_0|q4_0w\d+|[ST]\d+", x)]:
        raise SystemExit(f"--scorers: expected names like S8, T14, q4_0 or q4_0w1024 (a scoring window), got {bad}")
    captures = tuple(x.strip() for x in args.captures.split(",") if x.strip())
    if any(x not in ("flash", "softmax") for x in captures) or len(set(captures)) != len(captures):
        raise SystemExit(f"--captures: expected distinct names from flash, softmax, got {args.captures!r}")
    summary = answer_quality.run_eval(per_family, args.seed, args.words, args.quick, truncated, Path(args.out),
                                      early, args.only_scorers, captures)
    print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    return 0
