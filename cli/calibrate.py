"""``specgate calibrate``: measure and store SpecAttn's layer map for a model pair, or
(``--prefill N``) each model's faster prefill setting on this machine."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from cli.prefill import engine_config
from core import corpus
from core.decoding import layer_map
from core.errors import ConfigError
from core.llama.model import Model
from core.models import prefill_settings
from core.models.scorer_cuts import scoring_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--texts", nargs="*", default=None,
                        help=f"documents (stdlib:NAME, license:NAME or a path; default {corpus.CALIBRATION})")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per document")
    parser.add_argument("--queries", type=int, default=16, help="query positions captured per document")
    parser.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                        help="instead of the layer map: time each model's prefill of TOKENS tokens with flash "
                             "attention on and off and store the faster, which --target-flash-attn auto and "
                             "--attention-capture auto use (core/models/prefill_settings.py)")
    parser.add_argument("--out", default=None, help="where to write the map (default: next to the models, "
                                                    "keyed by both sha256, where the gateway looks)")


def run(args: argparse.Namespace) -> int:
    cfg = engine_config(args)
    if not 1 <= args.queries < args.tokens:
        raise ConfigError("need 1 <= --queries < --tokens")
    names = args.texts or corpus.available(corpus.CALIBRATION)
    if not names:
        raise ConfigError("no calibration texts found; pass --texts")
    scoring = scoring_model(cfg.scorer, cfg.target, cfg.speculator)  # the file the engine loads and keys by
    if args.prefill:
        return calibrate_prefill(cfg.target, scoring, names, args.prefill, cfg.n_threads, cfg.n_ubatch)
    target, speculator = Model(cfg.target), Model(scoring)
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


def calibrate_prefill(target: str, speculator: str, names: list[str], n_tokens: int, n_threads: int,
                      n_ubatch: int) -> int:
    if n_tokens < 64:
        raise ConfigError("--prefill needs at least 64 tokens")
    for path in dict.fromkeys((target, speculator)):
        model = Model(path)
        try:
            tokens: list[int] = []
            for name in names * (1 + n_tokens // 256):  # the texts again if they are shorter than asked
                tokens += model.tokenize(corpus.read(name))
                if len(tokens) >= n_tokens:
                    break
            measured = prefill_settings.measure(model, tokens[:n_tokens], n_threads, n_ubatch)
            out = prefill_settings.save(model, n_tokens, measured)
        finally:
            model.close()
        print(f"{Path(path).name}: " + ", ".join(f"flash attention {'on' if m.flash_attn else 'off'} "
                                                 f"{m.tokens_per_s:.1f} t/s" for m in measured) + f" -> {out}")
    return 0
