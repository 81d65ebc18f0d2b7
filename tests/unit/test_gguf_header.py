"""The GGUF header reader against files written by gguf's own ``GGUFWriter``: every scalar
type, strings, nested and string arrays stepped over, and a cut file refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from core.errors import ModelFileError
from core.llama.gguf_file import scalar_fields
from core.models import model_files


def write(path: Path) -> Path:
    w = GGUFWriter(str(path), "qwen2")
    w.add_context_length(32768)
    w.add_block_count(28)
    w.add_embedding_length(1536)
    w.add_head_count(12)
    w.add_head_count_kv(2)
    w.add_token_list([f"tok{i}" * (i % 5 + 1) for i in range(3000)])  # a string array, before more scalars
    w.add_array("test.nested", [[1, 2], [3, 4, 5]])
    w.add_array("test.floats", [0.5, 1.5])
    w.add_float32("test.f32", 0.25)
    w.add_float64("test.f64", -2.5)
    w.add_bool("test.bool", True)
    w.add_int8("test.i8", -3)
    w.add_uint16("test.u16", 65535)
    w.add_int64("test.i64", -(2 ** 40))
    w.add_uint64("test.u64", 2 ** 63)
    w.add_string("test.name", "héllo")
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_scalar_is_read_as_gguf_reads_it_and_arrays_are_stepped_over(tmp_path):
    path = write(tmp_path / "m.gguf")
    fields = scalar_fields(path)
    reader = GGUFReader(str(path))
    scalars = {k: f.contents() for k, f in reader.fields.items() if f.types and f.types[0].name != "ARRAY"
               and not k.startswith("GGUF.")}
    assert fields == pytest.approx(scalars)
    assert fields["test.u64"] == 2 ** 63 and fields["test.name"] == "héllo" and fields["test.bool"] is True
    assert "tokenizer.ggml.tokens" not in fields and "test.nested" not in fields
    assert model_files.trained_context(path) == 32768
    assert model_files.kv_bytes_per_token(path) == 2 * 2 * 28 * 2 * (1536 // 12)


def test_a_cut_header_is_a_model_file_error(tmp_path):
    path = write(tmp_path / "m.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:20_000])  # inside the token list
    with pytest.raises(ModelFileError, match="GGUF header unreadable"):
        scalar_fields(cut)
