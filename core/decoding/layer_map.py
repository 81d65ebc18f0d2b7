"""SpecAttn's layer map: measure it (``specgate calibrate``), store it, find it again.

Reduction to one distribution per layer: at each query position, a layer's
attention row is averaged over its heads (a mean of distributions is a
distribution, and the sparse view is one selection shared by all heads).
S[i][j] = -KL(A_target_j || A_draft_i) is computed per query position and
averaged over all query positions of all texts; the monotone map then comes
from core.decoding.specattn.monotone_layer_map.

The JSON is keyed by both model files' sha256 and lives next to the models,
so the gateway picks it up for exactly that pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from core.decoding.specattn import kl_similarity, monotone_layer_map, proportional_map
from core.errors import ConfigError
from core.kv import cells
from core.llama.capture import AttentionCapture
from core.llama.context import Context
from core.llama.model import Model
from core.models.model_files import cached_sha256, models_dir


@dataclass(slots=True, frozen=True)
class LayerMap:
    mapping: tuple[int, ...]  # target layer -> draft layer
    source: str  # "calibrated" | "proportional"
    target_sha256: str = ""
    speculator_sha256: str = ""


def default_path(target_sha: str, speculator_sha: str) -> Path:
    return models_dir() / "layer_maps" / f"{target_sha[:16]}-{speculator_sha[:16]}.json"


def load(target: Model, speculator: Model, explicit: str = "") -> LayerMap:
    """The calibrated map for this pair if one exists, else the relative-depth map."""
    t_sha, s_sha = cached_sha256(target.path), cached_sha256(speculator.path)
    path = Path(explicit).expanduser() if explicit else default_path(t_sha, s_sha)
    if not path.is_file():
        if explicit:
            raise ConfigError(f"layer map not found: {path}")
        return LayerMap(tuple(proportional_map(target.n_layer, speculator.n_layer).tolist()), "proportional")
    try:
        data = orjson.loads(path.read_bytes())
        mapping = tuple(int(i) for i in data["map"])
        keys = (data["target_sha256"], data["speculator_sha256"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"unreadable layer map {path}: {exc}") from exc
    if keys != (t_sha, s_sha):
        raise ConfigError(f"layer map {path} was calibrated for other model files")
    if len(mapping) != target.n_layer or not all(0 <= i < speculator.n_layer for i in mapping):
        raise ConfigError(f"layer map {path} does not fit {target.n_layer} target / "
                          f"{speculator.n_layer} draft layers")
    return LayerMap(mapping, "calibrated", t_sha, s_sha)


def save(path: Path, layer_map: LayerMap, similarity: np.ndarray, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"target_sha256": layer_map.target_sha256, "speculator_sha256": layer_map.speculator_sha256,
           "map": list(layer_map.mapping), "similarity": np.round(similarity, 4).tolist(), **meta}
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))


def layer_rows(ctx: Context, capture: AttentionCapture, tokens: Sequence[int], n_queries: int) -> list[np.ndarray]:
    """Prefill all but the last ``n_queries`` tokens, then decode those one by one and
    keep each step's head-averaged rows: [n_layer, n_keys] per query."""
    n_prefix = len(tokens) - n_queries
    cells.empty(ctx)
    ctx.decode(tokens[:n_prefix], 0, logits_last=False)
    rows = []
    for i in range(n_prefix, len(tokens)):
        capture.start(i + 1)
        ctx.decode([tokens[i]], i)
        rows.append(capture.stop().mean(axis=1))
    cells.empty(ctx)
    return rows


def similarity(target_rows: list[np.ndarray], draft_rows: list[np.ndarray]) -> np.ndarray:
    """Mean over query positions of S[i, j] = -KL(target layer j || draft layer i)."""
    return np.mean([kl_similarity(t, d) for t, d in zip(target_rows, draft_rows, strict=True)], axis=0)


def calibrate(target: Model, speculator: Model, texts: Sequence[Sequence[int]], n_queries: int,
              n_threads: int) -> tuple[LayerMap, np.ndarray]:
    """Capture both models on ``texts`` (token lists), and solve the monotone map."""
    n_ctx = max(len(t) for t in texts) + 8
    t_rows: list[np.ndarray] = []
    d_rows: list[np.ndarray] = []
    for model, out in ((target, t_rows), (speculator, d_rows)):
        capture = AttentionCapture(model.n_layer)
        ctx = Context(model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=n_threads,
                      flash_attn=False, capture=capture)
        try:
            for tokens in texts:
                out.extend(layer_rows(ctx, capture, tokens, n_queries))
        finally:
            ctx.close()
    sim = similarity(t_rows, d_rows)
    mapping = tuple(monotone_layer_map(sim).tolist())
    return LayerMap(mapping, "calibrated", cached_sha256(target.path), cached_sha256(speculator.path)), sim
