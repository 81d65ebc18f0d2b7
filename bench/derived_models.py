"""Derive smaller GGUF models (same tokenizer, fewer blocks) with the ``gguf`` package.

The tests run on them (fast, real tokenizer), the benches use them for the
gateway-overhead scenario, and the evals as layer-truncated scorers; all three
share one cache (:func:`derived`).  The ``gguf`` package is imported lazily: it
is a test/bench dependency, not a serving one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from core import model_files

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def truncate_blocks(src: str | Path, dst: str | Path, n_blocks: int) -> Path:
    """Write ``dst``: ``src`` with only its first ``n_blocks`` transformer blocks."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch_field = reader.fields[gguf.Keys.General.ARCHITECTURE]
    arch = arch_field.contents()
    block_key = f"{arch}.block_count"
    have = int(reader.fields[block_key].contents())
    if not 1 <= n_blocks <= have:
        raise ValueError(f"n_blocks must be in [1, {have}], got {n_blocks}")
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
    tmp.replace(dst)
    return dst


def derived_dir() -> Path:
    """``SPECGATE_DERIVED_DIR``, else ``derived/`` in the models folder."""
    explicit = os.environ.get("SPECGATE_DERIVED_DIR")
    d = Path(explicit).expanduser() if explicit else model_files.models_dir() / "derived"
    d.mkdir(parents=True, exist_ok=True)
    return d


def derived(n_blocks: int, spec: model_files.ModelSpec = model_files.SPECULATOR) -> Path:
    """A fetched model (the speculator by default) cut to its first ``n_blocks`` blocks,
    written once and cached."""
    src = model_files.model_path(spec)
    if not model_files.is_verified(spec, src):
        raise model_files.FetchError(f"{spec.name} missing at {src}: run `specgate fetch-models`")
    dst = derived_dir() / f"{spec.name}-{n_blocks}blk-{spec.sha256[:8]}.gguf"
    if not dst.exists():
        truncate_blocks(src, dst, n_blocks)
    return dst
