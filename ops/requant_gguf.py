"""Write a copy of a GGUF model whose block weights are re-quantized to another type.

    .venv/bin/python ops/requant_gguf.py SRC.gguf DST.gguf Q4_0      # or Q8_0

A measurement aid (results/planner.md, "Where the speculator's time goes"): the 0.5B
speculator's Q4_K_M file holds most matrices as Q5_0, because its 896-wide rows are no
multiple of 256 and K-quants need that, and llama.cpp's CPU backend repacks Q4_0 and
Q4_K (8x8 interleaved GEMM) but not Q5_0.  Q8_0 keeps the values (to 1/254 of a block's
range); Q4_0 rounds 5-bit weights to 4 bits, so it changes the model.  The embedding
and output matrices are copied as they are.
"""

from __future__ import annotations

import sys

import gguf
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

CONVERTIBLE = {GGMLQuantizationType[t] for t in ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}


def requantize(src: str, dst: str, target: GGMLQuantizationType) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    tensors = []
    for t in reader.tensors:
        convert = t.name.startswith("blk.") and t.tensor_type in CONVERTIBLE and t.tensor_type != target
        data = quantize(dequantize(t.data, t.tensor_type), target) if convert else t.data
        tensors.append((t.name, data, target if convert else t.tensor_type))
    for name, data, kind in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()


if __name__ == "__main__":
    requantize(sys.argv[1], sys.argv[2], GGMLQuantizationType[sys.argv[3]])
