"""Derive smaller GGUF models (same tokenizer, fewer blocks) with the ``gguf`` package.

Used for fast tests and for layer-truncated scorers.  The ``gguf`` package is
imported lazily: it is a test/bench dependency, not a serving one.
"""

from __future__ import annotations

import re
from pathlib import Path

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
