"""``specgate calibrate``: measure and store SpecAttn's layer map for a model pair."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from cli.prefill import engine_config
from core import corpus
from core.decoding import layer_map
from core.errors import ConfigError
from core.llama.model import Model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--texts", nargs="*", default=None,
                        help=f"documents (stdlib:NAME, license:NAME or a path; default {corpus.CALIBRATION})")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per document")
    parser.add_argument("--queries", type=int, default=16, help="query positions captured per document")
    parser.add_argument("--out", default=None, help="where to write the map (default: next to the models, "
                                                    "keyed by both sha256, where the gateway looks)")


def run(args: argparse.Namespace) -> int:
    cfg = engine_config(args)
    if not 1 <= args.queries < args.tokens:
        raise ConfigError("need 1 <= --queries < --tokens")
    names = args.texts or corpus.available(corpus.CALIBRATION)
    if not names:
        raise ConfigError("no calibration texts found; pass --texts")
    target, speculator = Model(cfg.target), Model(cfg.speculator)
    try:
        texts = [target.tokenize(corpus.read(n))[: args.tokens] for n in names]
        t0 = time.perf_counter()
        lmap, sim = layer_map.calibrate(target, speculator, texts, args.queries, cfg.n_threads)
        out = Path(args.out) if args.out else layer_map.default_path(lmap.target_sha256, lmap.speculator_sha256)
        layer_map.save(out, lmap, sim, {"texts": names, "tokens_per_text": [len(t) for t in texts],
                                        "queries_per_text": args.queries,
                                        "reduction": "heads averaged per layer; -KL averaged over queries"})
    finally:
        target.close()
        speculator.close()
    print(f"layer map ({time.perf_counter() - t0:.1f} s, {len(texts)} texts) -> {out}")
    print("target layer -> draft layer:", " ".join(f"{j}:{i}" for j, i in enumerate(lmap.mapping)))
    return 0
