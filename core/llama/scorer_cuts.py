"""Which model scores a prompt: the speculator, or the first R blocks of either model.

``speculator-full`` is the SpecPrefill guide's scorer.  ``speculator-early:R`` and
``target-early:R`` are GemFilter-style filters (Shi et al., 2024): the model cut to
its first R transformer blocks, written once with the ``gguf`` package into the
derived-models folder and loaded as the scoring model.  The engine and the planner
see one scoring model whichever it is; the planner's cost model calibrates and
refines its speed like any other's.  Pair an early scorer with ``--score-agg
filter-sum`` to read its last layer the way GemFilter does (results/scorers.md,
"A cheaper scorer").
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from core.errors import ConfigError
from core.llama import model_files
from core.policies import Scorer, ScorerKind

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def truncate_blocks(src: str | Path, dst: str | Path, n_blocks: int) -> Path:
    """Write ``dst``: ``src`` with only its first ``n_blocks`` transformer blocks."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    block_key = f"{arch}.block_count"
    have = int(reader.fields[block_key].contents())
    if not 1 <= n_blocks <= have:
        raise ConfigError(f"{Path(src).name} has {have} blocks: a cut must keep 1 to {have}, got {n_blocks}")
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = n_blocks if field.name == block_key else field.contents()
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)
    tensors = [t for t in reader.tensors
               if not (m := _BLOCK.match(t.name)) or int(m.group(1)) < n_blocks]
    for t in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    tmp.replace(dst)  # a stopped write never leaves a file that looks complete
    return dst


def derived_dir() -> Path:
    """``SPECGATE_DERIVED_DIR``, else ``derived/`` in the models folder."""
    explicit = os.environ.get("SPECGATE_DERIVED_DIR")
    d = Path(explicit).expanduser() if explicit else model_files.models_dir() / "derived"
    d.mkdir(parents=True, exist_ok=True)
    return d


def cut(src: str | Path, n_blocks: int, sha256: str = "") -> Path:
    """``src`` cut to its first ``n_blocks`` blocks, written once and cached under a name
    that carries the source's hash (``sha256`` when the caller already knows it)."""
    src = Path(src)
    if not src.is_file():
        raise ConfigError(f"cannot cut {src}: no such model file")
    sha = sha256 or model_files.cached_sha256(src)
    dst = derived_dir() / f"{src.stem}-{n_blocks}blk-{sha[:8]}.gguf"
    if not dst.exists():
        truncate_blocks(src, dst, n_blocks)
    return dst


def scoring_model(scorer: str, target: str, speculator: str) -> str:
    """The GGUF file that scores prompts for ``scorer`` (:meth:`Scorer.parse`)."""
    s = Scorer.parse(scorer)
    if s.kind is ScorerKind.SPECULATOR_FULL:
        return speculator
    return str(cut(speculator if s.kind is ScorerKind.SPECULATOR_EARLY else target, s.blocks))
