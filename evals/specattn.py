"""``specgate eval --specattn``: perplexity against KV access, as in the SpecAttn paper.

Protocol: tokenize a long real text, prefill the target densely, then score the
last 90% token by token.  At step i the draft decodes token i (capturing its
attention rows), each method picks the cells among 0..i-1 the target may
attend to, and the target decodes token i through that view
(Context.decode(seqs=(VIEW_SEQ,)), a throwaway cell) to give the NLL of token
i+1.  Every method sees the same dense cache of the earlier tokens, so the
figure isolates the current step's attention selection (no error compounding
through sparse K/V of earlier steps); this is also exactly what one SpecAttn
verification does.

Methods, all one cell selection shared by every layer and head:
  dense      every cell;
  specattn_p draft rows (heads averaged, layers mixed by the layer map), top-p by
             bisection, plus 4 sink cells and the previous token;
  streaming  4 sinks + the most recent cells, the same count as specattn at the
             budget p (StreamingLLM-style);
  quest      pages of 16 cells ranked by the Quest upper bound
             sum_d max(q_d kmin_d, q_d kmax_d) from the target's own post-RoPE
             query of token i and per-page key bounds, summed over layers and
             KV heads after a per-(layer, head) softmax; the same count as the
             budget p (a single-selection adaptation of Quest).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core import corpus
from core.decoding import layer_map
from core.decoding.specattn import layer_weights, select_cells
from core.llama.capture import AttentionCapture, QKCapture
from core.llama.context import VIEW_SEQ, Context
from core.llama.model import Model
from core.spans import runs

SINKS = 4
PAGE = 16


@dataclass(slots=True, frozen=True)
class PplSetup:
    text: str
    n_tokens: int
    ps: tuple[float, ...]
    budget_p: float  # the SpecAttn p whose cell count the fixed-budget baselines get
    prefix_frac: float = 0.1


def streaming_mask(n: int, budget: int) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    mask[:SINKS] = True
    recent = max(budget - SINKS, 1)
    mask[max(0, n - recent):] = True
    return mask


def quest_mask(q: np.ndarray, k_min: np.ndarray, k_max: np.ndarray, n: int, budget: int,
               n_kv_head: int) -> np.ndarray:
    """``q``: [n_layer, n_head, d] of the current token; ``k_min``/``k_max``:
    [n_layer, n_kv_head, n_pages, d] over the first ``n`` cells."""
    n_layer, n_head, d = q.shape
    group = n_head // n_kv_head
    qg = q.reshape(n_layer, n_kv_head, group, d)
    bound = np.maximum(qg[:, :, :, None, :] * k_min[:, :, None], qg[:, :, :, None, :] * k_max[:, :, None]).sum(-1)
    bound = bound / math.sqrt(d)  # [n_layer, n_kv_head, group, n_pages]
    w = np.exp(bound - bound.max(axis=-1, keepdims=True))
    page_score = (w / w.sum(axis=-1, keepdims=True)).sum(axis=(0, 1, 2))
    mask = np.zeros(n, dtype=bool)
    mask[:SINKS] = True
    mask[n - 1] = True
    for page in np.argsort(-page_score, kind="stable"):
        if mask.sum() >= budget:
            break
        mask[page * PAGE: (page + 1) * PAGE] = True
    return mask


def page_bounds(keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``keys``: [n_layer, n_kv_head, n_tokens, d] -> per-page min/max over the first n."""
    n_pages = math.ceil(n / PAGE)
    pad = n_pages * PAGE - n
    k = keys[:, :, :n]
    lo = np.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=np.inf)
    hi = np.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=-np.inf)
    shape = k.shape[:2] + (n_pages, PAGE, k.shape[-1])
    return lo.reshape(shape).min(axis=3), hi.reshape(shape).max(axis=3)


def view_nll(ctx: Context, token: int, nxt: int, pos: int, mask: np.ndarray) -> float:
    ctx.seq().make_view(runs(np.flatnonzero(mask)))
    try:
        ctx.decode([token], pos, seqs=(VIEW_SEQ,))
        logits = ctx.logits().astype(np.float64)
    finally:
        ctx.seq().drop_view()
    top = logits.max()
    return float(top + math.log(np.exp(logits - top).sum()) - logits[nxt])


class PerplexityRun:
    """Both models over one text; ``step(i)`` scores token i+1 under every method."""

    def __init__(self, target: Model, draft: Model, setup: PplSetup, n_threads: int) -> None:
        self.setup = setup
        self.tokens = target.tokenize(corpus.read(setup.text), add_special=False)[: setup.n_tokens]
        n_ctx = len(self.tokens) + 16
        self.qk = QKCapture(target.n_layer)
        self.target = Context(target, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=n_threads,
                              flash_attn=True, views=True, probe=self.qk)
        self.capture = AttentionCapture(draft.n_layer)
        self.draft = Context(draft, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=n_threads,
                             flash_attn=False, capture=self.capture)
        lmap = layer_map.load(target, draft)
        self.map_source = lmap.source
        self.weights = layer_weights(np.asarray(lmap.mapping), draft.n_layer)
        self.keys = np.empty((0, 0, 0, 0), dtype=np.float32)  # [n_layer, n_kv_head, n, d], set by prefill

    def close(self) -> None:
        self.target.close()
        self.draft.close()

    def prefill(self) -> int:
        n0 = max(SINKS + 1, int(len(self.tokens) * self.setup.prefix_frac))
        self.qk.start_keys()
        self.target.decode(self.tokens, 0, logits_last=False)
        self.keys = self.qk.stop_keys()
        self.draft.decode(self.tokens[:n0], 0, logits_last=False)
        return n0

    def masks(self, i: int) -> dict[str, np.ndarray]:
        self.capture.start(i + 1)
        self.draft.decode([self.tokens[i]], i)
        step = self.capture.stop()
        out = {"dense": np.ones(i, dtype=bool)}
        for p in self.setup.ps:
            out[f"specattn_p{p}"] = select_cells([step], self.weights, p, i, SINKS)
        budget = int(out[f"specattn_p{self.setup.budget_p}"].sum())
        out["streaming"] = streaming_mask(i, budget)
        q = self.query(i)
        k_min, k_max = page_bounds(self.keys, i)
        out["quest"] = quest_mask(q, k_min, k_max, i, budget, self.keys.shape[1])
        return out

    def query(self, i: int) -> np.ndarray:
        """The target's own query of token i (post-RoPE), from a throwaway dense probe."""
        self.qk.start_query()
        self.target.seq().make_view([(0, i)])
        try:
            self.target.decode([self.tokens[i]], i, seqs=(VIEW_SEQ,))
        finally:
            self.target.seq().drop_view()
        return self.qk.stop_query()


def perplexity(target: Model, draft: Model, setup: PplSetup, n_threads: int,
               progress: Callable[[str], None]) -> dict:
    run = PerplexityRun(target, draft, setup, n_threads)
    try:
        t0 = time.perf_counter()
        n0 = run.prefill()
        nll: dict[str, list[float]] = {}
        frac: dict[str, list[float]] = {}
        n = len(run.tokens)
        for i in range(n0, n - 1):
            for name, mask in run.masks(i).items():
                nll.setdefault(name, []).append(view_nll(run.target, run.tokens[i], run.tokens[i + 1], i, mask))
                frac.setdefault(name, []).append(float(mask.sum()) / i)
            if (i - n0) % 100 == 0:
                progress(f"  {setup.text}: token {i}/{n} ({time.perf_counter() - t0:.0f} s)")
    finally:
        run.close()
    methods = {}
    for name in nll:
        kept = float(np.mean(frac[name]))
        tail = len(frac[name]) * 3 // 4  # the last quarter: the longest contexts of the run
        methods[name] = {"ppl": float(np.exp(np.mean(nll[name]))), "kv_kept": kept, "kv_reduction": 1 - kept,
                         "kv_reduction_last_quarter": 1 - float(np.mean(frac[name][tail:])),
                         "nll": [round(x, 4) for x in nll[name]], "kept": [round(x, 4) for x in frac[name]]}
    return {"text": setup.text, "n_tokens": n, "n_prefix": n0, "n_scored": n - 1 - n0,
            "layer_map": run.map_source, "budget_p": setup.budget_p, "methods": methods,
            "seconds": time.perf_counter() - t0}


def run_specattn(args: Any) -> dict:
    from bench import plots
    from bench.common import progress, write_result
    from core.config import EngineConfig
    from core.models.model_files import with_default_models
    from evals import specattn_decode

    cfg = with_default_models(EngineConfig(scorer="speculator-full"))  # drafts with the file as fetched
    target, speculator = cfg.target, cfg.speculator
    models = {"target": target, "speculator": speculator}
    ps = tuple(float(x) for x in args.ps.split(",") if x)
    out = Path(args.out)
    ppl = []
    texts = [t for t in args.ppl_texts.split(",") if t]
    if texts:
        t_model, d_model = Model(target), Model(speculator)
        try:
            for text in texts:
                progress(f"perplexity on {text}")
                ppl.append(perplexity(t_model, d_model, PplSetup(text, args.ppl_tokens, ps, ps[0]), os.cpu_count() or 1,
                                      progress))
        finally:
            t_model.close()
            d_model.close()
        write_result(out / "specattn_ppl.json", "specattn_perplexity", {"texts": ppl}, models)
        plots.specattn_ppl(ppl, out / "specattn_ppl.png")
    setup = specattn_decode.DecodeSetup(tuple(int(x) for x in args.contexts.split(",") if x), args.decode_tokens,
                                        ps, args.gamma)
    decode = []
    for n_ctx in setup.contexts:
        progress(f"decode speed at {n_ctx} tokens")
        decode.append(specattn_decode.at_context(target, speculator, n_ctx, setup))
    if decode:
        write_result(out / "specattn_decode.json", "specattn_decode", {"contexts": decode}, models)
        plots.specattn_decode(decode, out / "specattn_decode.png")
    return {"perplexity": [{k: v for k, v in r.items() if k != "methods"} | {
        "methods": {m: {k: round(x, 4) for k, x in v.items() if k not in ("nll", "kept")}
                    for m, v in r["methods"].items()}}
        for r in ppl], "decode": [{**c, "rows": [{k: v for k, v in row.items() if k != "text"} for row in c["rows"]]}
                                  for c in decode]}
