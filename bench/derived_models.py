"""Smaller GGUF models derived from the fetched ones (same tokenizer, fewer blocks).

The tests run on them (fast, real tokenizer), the benches use them for the
gateway-overhead scenario, and the evals as layer-truncated scorers; they share
one cache with the server's early scorers (core.models.scorer_cuts).
"""

from __future__ import annotations

from pathlib import Path

from core.models import model_files
from core.models.scorer_cuts import cut


def derived(n_blocks: int, spec: model_files.ModelSpec = model_files.SPECULATOR) -> Path:
    """A fetched model (the speculator by default) cut to its first ``n_blocks`` blocks."""
    src = model_files.model_path(spec)
    if not model_files.is_verified(spec, src):
        raise model_files.FetchError(f"{spec.name} missing at {src}: run `specgate fetch-models`")
    return cut(src, n_blocks, spec.sha256)
