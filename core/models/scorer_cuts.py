"""Which model scores prompts: the speculator, its Q4_0 copy, or the first R blocks of
either model.

``speculator-full`` is the SpecPrefill guide's scorer.  ``speculator-early:R`` and
``target-early:R`` are GemFilter-style filters (Shi et al., 2024): the model cut to
its first R transformer blocks.  ``speculator-q4_0`` is the whole speculator with its
block weights re-quantized to Q4_0: the Q4_K_M 0.5B holds most matrices as Q5_0 (its
896-wide rows are no multiple of 256, which K-quants need), and llama.cpp's CPU backend
repacks Q4_0 and Q4_K into its interleaved 8x8 GEMM but not Q5_0, so the copy prefills
about 1.5x faster on AVX2 CPUs (results/planner.md); 4-bit weights change the model a
little.  Each file is written once with the ``gguf`` package into the derived-models
folder and loaded as the scoring model.  The engine and the planner see one scoring
model whichever it is; the planner's cost model calibrates and refines its speed like
any other's.  Pair an early scorer with ``--score-agg filter-sum`` to read its last
layer the way GemFilter does (results/scorers.md, "A cheaper scorer").
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.errors import ConfigError
from core.llama.gguf_file import validate_gguf
from core.models import model_files
from core.policies import Scorer, ScorerKind

_BLOCK = re.compile(r"^blk\.(\d+)\.")
REQUANTIZABLE = ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # block weight types re-quantized


def _write_copy(reader: Any, dst: str | Path, fields: Callable[[str, Any], Any],
                tensors: Callable[[Any], tuple[Any, Any] | None]) -> Path:
    """Write ``dst``: the metadata of the model ``reader`` (a ``gguf.GGUFReader``) holds,
    with ``fields(name, value)`` applied, and each tensor as ``tensors(t)`` gives it
    (``(data, type)``, or None to drop it).  Written beside ``dst`` and renamed, so a
    stopped write never leaves a file that looks complete, and two writers never mix."""
    import gguf

    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    dst = Path(dst)
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.partial")  # servers started together may each write it
    writer = gguf.GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, fields(field.name, field.contents()), val_type, sub_type=sub_type)
    kept = [(t.name, *out) for t in reader.tensors if (out := tensors(t)) is not None]
    for name, data, kind in kept:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in kept:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    tmp.replace(dst)
    return dst


def truncate_blocks(src: str | Path, dst: str | Path, n_blocks: int) -> Path:
    """Write ``dst``: ``src`` with only its first ``n_blocks`` transformer blocks."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    block_key = f"{reader.fields[gguf.Keys.General.ARCHITECTURE].contents()}.block_count"
    have = int(reader.fields[block_key].contents())
    if not 1 <= n_blocks <= have:
        raise ConfigError(f"{Path(src).name} has {have} blocks: a cut must keep 1 to {have}, got {n_blocks}")

    def in_cut(t: Any) -> tuple[Any, Any] | None:
        m = _BLOCK.match(t.name)
        return (t.data, t.tensor_type) if not m or int(m.group(1)) < n_blocks else None
    return _write_copy(reader, dst, lambda name, value: n_blocks if name == block_key else value, in_cut)


def requantize_blocks(src: str | Path, dst: str | Path, target: str) -> Path:
    """Write ``dst``: ``src`` with every block weight of a :data:`REQUANTIZABLE` type
    dequantized and quantized again to ``target`` (the embedding and output matrices and
    the f32 norms are copied as they are)."""
    import gguf
    from gguf.quants import dequantize, quantize

    to = gguf.GGMLQuantizationType[target]

    def converted(t: Any) -> tuple[Any, Any]:
        if t.name.startswith("blk.") and t.tensor_type.name in REQUANTIZABLE and t.tensor_type != to:
            return quantize(dequantize(t.data, t.tensor_type), to), to
        return t.data, t.tensor_type
    return _write_copy(gguf.GGUFReader(str(src)), dst, lambda name, value: value, converted)


def derived_dir() -> Path:
    """``SPECGATE_DERIVED_DIR``, else ``derived/`` in the models folder."""
    explicit = os.environ.get("SPECGATE_DERIVED_DIR")
    d = Path(explicit).expanduser() if explicit else model_files.models_dir() / "derived"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _cached(src: str | Path, suffix: str, write: Callable[[Path, Path], Path], sha256: str) -> Path:
    """A derived copy of ``src``, written once by ``write(src, dst)`` and cached under a name
    that carries the source's hash (``sha256`` when the caller already knows it)."""
    src = validate_gguf(src)  # a bad file gets the error the engine gives any model file
    sha = sha256 or model_files.cached_sha256(src)
    dst = derived_dir() / f"{src.stem}-{suffix}-{sha[:8]}.gguf"
    return dst if dst.exists() else write(src, dst)


def cut(src: str | Path, n_blocks: int, sha256: str = "") -> Path:
    """``src`` cut to its first ``n_blocks`` blocks (cached)."""
    return _cached(src, f"{n_blocks}blk", lambda s, d: truncate_blocks(s, d, n_blocks), sha256)


def requantized(src: str | Path, target: str = "Q4_0", sha256: str = "") -> Path:
    """``src`` with its block weights re-quantized to ``target`` (cached)."""
    return _cached(src, target.lower(), lambda s, d: requantize_blocks(s, d, target), sha256)


def scoring_model(scorer: str, target: str, speculator: str) -> str:
    """The GGUF file that scores prompts for ``scorer`` (:meth:`Scorer.parse`)."""
    s = Scorer.parse(scorer)
    if s.kind is ScorerKind.SPECULATOR_FULL:
        return speculator
    if s.kind is ScorerKind.SPECULATOR_Q4_0:
        return str(requantized(speculator, "Q4_0"))
    return str(cut(speculator if s.kind is ScorerKind.SPECULATOR_EARLY else target, s.blocks))


def derived(n_blocks: int, spec: model_files.ModelSpec = model_files.SPECULATOR) -> Path:
    """A fetched model (the speculator by default) cut to its first ``n_blocks`` blocks: what
    the tests run on (fast, the real tokenizer), the overhead bench serves and the evals
    score with, in the scorers' cache."""
    src = model_files.model_path(spec)
    if not model_files.is_verified(spec, src):
        raise model_files.FetchError(f"{spec.name} missing at {src}: run `specgate fetch-models`")
    return cut(src, n_blocks, spec.sha256)
