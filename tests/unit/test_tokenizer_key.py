"""The grammar tokenizers' cache (core/decoding/guided.py) names a model by more than the
address of its vocabulary: a model loaded where a closed one was must not get its tokenizer."""

from __future__ import annotations

from types import SimpleNamespace

from core.decoding.guided import tokenizer_key


def test_a_model_loaded_at_a_freed_vocabularys_address_is_another_key():
    qwen = SimpleNamespace(vocab=0x7F00_1000, n_vocab=151_936, path="/m/qwen2.5-coder-0.5b.gguf")
    smol = SimpleNamespace(vocab=0x7F00_1000, n_vocab=49_152, path="/m/SmolLM2-135M.gguf")
    again = SimpleNamespace(vocab=0x7F00_1000, n_vocab=151_936, path="/m/qwen2.5-coder-0.5b.gguf")
    assert tokenizer_key(qwen) != tokenizer_key(smol)
    assert tokenizer_key(qwen) == tokenizer_key(again)  # the same file at the same address: the same vocabulary
