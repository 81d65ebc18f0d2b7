"""A selection widened to whole lines and code blocks (core/specprefill/lines.py), on token
pieces as a tokenizer cuts them, with and without cat -n numbers."""

from __future__ import annotations

import numpy as np

from core.specprefill.lines import focus, lines_of, names_in, recall, widen

SOURCE = ["x = 1\n", "def foo(a):\n", "    b = a\n", "\n", "    return b\n", "y = 2\n", "class K:\n",
          "    def m(self):\n", "        pass\n", "z = 3\n"]


def pieces(text: str, width: int = 3) -> list[bytes]:
    """Cut ``text`` into pieces of ``width`` bytes (a tokenizer's pieces straddle lines too)."""
    raw = text.encode()
    return [raw[i:i + width] for i in range(0, len(raw), width)]


def at(p: list[bytes], needle: bytes) -> int:
    """The piece holding the first byte of ``needle``."""
    offset = b"".join(p).index(needle)
    return int(np.searchsorted(np.cumsum([len(x) for x in p]), offset, side="right"))


def kept_text(p: list[bytes], mask: np.ndarray) -> str:
    return b"".join(x for x, k in zip(p, mask, strict=True) if k).decode()


def test_a_kept_token_keeps_its_line_and_a_kept_def_keeps_its_body():
    for numbered in (False, True):
        lines = [f"{i:>6}\t{x}" for i, x in enumerate(SOURCE, 1)] if numbered else SOURCE
        p = pieces("".join(lines))
        info = lines_of(p)
        head = at(p, b"foo")  # a piece of the def line
        mask = np.zeros(len(p), dtype=bool)
        mask[head] = True
        one_line = kept_text(p, widen(mask, info, whole_lines=True, blocks=False))
        assert "def foo(a):" in one_line and "b = a" not in one_line
        block = kept_text(p, widen(mask, info, whole_lines=True, blocks=True))
        assert "def foo(a):" in block and "return b" in block and "y = 2" not in block and "x = 1" not in block
        nested = np.zeros(len(p), dtype=bool)
        nested[at(p, b"K:")] = True
        cls = kept_text(p, widen(nested, info, whole_lines=True, blocks=True))
        assert "def m(self):" in cls and "pass" in cls and "z = 3" not in cls


def test_blocks_alone_add_the_body_and_leave_the_chosen_tokens_as_they_were():
    p = pieces("".join(SOURCE))
    info = lines_of(p)
    mask = np.zeros(len(p), dtype=bool)
    mask[at(p, b"foo")] = True
    out = widen(mask, info, whole_lines=False, blocks=True)
    assert "return b" in kept_text(p, out) and out[mask].all()
    assert not widen(np.zeros(len(p), dtype=bool), info, True, True).any()
    assert np.array_equal(widen(mask, info, False, False), mask)


def test_the_skeleton_keeps_top_level_and_def_lines_whatever_their_scores():
    lines = [f"{i:>6}\t{x}" for i, x in enumerate(SOURCE, 1)]
    p = pieces("".join(lines))
    info = lines_of(p)
    mask = np.zeros(len(p), dtype=bool)
    mask[at(p, b"return b")] = True
    text = kept_text(p, widen(mask, info, whole_lines=True, blocks=False, skeleton=True))
    for line in ("x = 1", "def foo(a):", "y = 2", "class K:", "def m(self):", "z = 3", "return b"):
        assert line in text
    assert "b = a" not in text and "pass" not in text
    assert "1\tx = 1" in text  # with its line number


def test_the_skeletons_def_lines_open_no_block():
    p = pieces("".join(SOURCE))
    info = lines_of(p)
    mask = np.zeros(len(p), dtype=bool)
    mask[at(p, b"x = 1")] = True
    text = kept_text(p, widen(mask, info, whole_lines=True, blocks=True, skeleton=True))
    assert "def foo(a):" in text and "return b" not in text and "pass" not in text


def test_a_request_names_code_shaped_words_and_quoted_ones_not_english():
    names = names_in("Read src/pkg/mod_3.py. Then reply with the source of `parse` and the value of "
                     "MAX_RETRIES, and where retryCount is set; the function and the file")
    assert names == {b"mod_3", b"parse", b"MAX_RETRIES", b"retryCount"}
    assert names_in("the function and the file, please") == frozenset()
    assert len(names_in(" ".join(f"name_{i}" for i in range(100)))) == 32


def test_named_lines_are_kept_whatever_their_scores_and_a_named_def_keeps_its_body():
    lines = [f"{i:>6}\t{x}" for i, x in enumerate(SOURCE, 1)]
    p = pieces("".join(lines))
    mask = np.zeros(len(p), dtype=bool)
    mask[at(p, b"z = 3")] = True
    text = kept_text(p, widen(mask, lines_of(p, frozenset({b"foo", b"y"})), whole_lines=False, blocks=False,
                              named=True))
    for line in ("2\tdef foo(a):", "b = a", "return b", "6\ty = 2"):
        assert line in text
    assert "x = 1" not in text and "class K" not in text and "pass" not in text
    unnamed = widen(mask, lines_of(p, frozenset({b"fo"})), whole_lines=False, blocks=False, named=True)
    assert np.array_equal(unnamed, mask)  # a name matches whole words only
    off = widen(mask, lines_of(p, frozenset({b"foo"})), whole_lines=False, blocks=False, named=False)
    assert np.array_equal(off, mask)


def test_lines_longer_than_the_bound_stay_as_scored():
    """A one-line JSON result or an unwrapped paragraph is one "line" of the whole prompt:
    widened, it would keep every token; over the bound it keeps only what was scored, named
    or not, while the short lines beside it are still widened."""
    long_line = "prose " * 60 + "parse_header here " + "prose " * 60 + "\n"
    p = pieces("x = 1\n" + long_line + "y = 2\n")
    info = lines_of(p, frozenset({b"parse_header"}))
    assert info.n_tokens.sum() == len(p) and info.n_tokens[1] > 100
    mask = np.zeros(len(p), dtype=bool)
    mask[at(p, b"prose")] = True
    mask[at(p, b"y = 2")] = True
    out = widen(mask, info, whole_lines=True, blocks=False, skeleton=True, named=True, max_line_tokens=32)
    assert np.array_equal(out[info.of_token == 1], mask[info.of_token == 1])  # the long line: as scored
    assert "y = 2" in kept_text(p, out) and "x = 1" in kept_text(p, out)  # short lines: widened, skeleton
    unbounded = widen(mask, info, whole_lines=True, blocks=False, named=True)
    assert unbounded[info.of_token == 1].all()


def test_recall_brings_back_the_dropped_tokens_of_a_named_def_and_nothing_else():
    p = pieces("".join(SOURCE))
    info = lines_of(p, frozenset({b"foo"}))
    dropped = np.ones(len(p), dtype=bool)
    dropped[:at(p, b"def foo")] = False  # what comes before the def is held
    got = recall(dropped, info, max_tokens=1000)
    text = kept_text(p, np.isin(np.arange(len(p)), got))
    assert "def foo(a):" in text and "return b" in text and "class K" not in text
    assert np.all(dropped[got]) and np.all(np.diff(got) > 0)
    none_dropped = recall(np.zeros(len(p), dtype=bool), info, max_tokens=1000)
    assert none_dropped.size == 0
    newest = recall(dropped, info, max_tokens=3)
    assert list(newest) == list(got[-3:])
    assert recall(dropped, info, max_tokens=0).size == 0
    assert recall(dropped, lines_of(p), max_tokens=1000).size == 0  # nothing named


def test_recall_brings_a_named_block_back_as_one_run_with_its_kept_lines_between():
    """A body line kept between two dropped ones is prefilled again inside the run, so the
    run after it attends to it; kept lines before the first dropped token and after the last
    stay as they are, and nothing outside the named block comes back."""
    p = pieces("".join(SOURCE))
    info = lines_of(p, frozenset({b"foo"}))
    dropped = np.ones(len(p), dtype=bool)
    dropped[:at(p, b"def foo")] = False
    kept_line = np.flatnonzero(info.of_token == 2)  # "    b = a", kept by the earlier prefill
    dropped[kept_line] = False
    got = recall(dropped, info, max_tokens=1000)
    assert np.all(np.diff(got) == 1), "the block came back as more than one run"
    assert set(kept_line.tolist()) <= set(got.tolist())
    assert got[0] == np.flatnonzero(dropped)[0] and "return b" in kept_text(p, np.isin(np.arange(len(p)), got))
    assert "class K" not in kept_text(p, np.isin(np.arange(len(p)), got))
    whole = np.zeros(len(p), dtype=bool)
    whole[:at(p, b"    b = a")] = True  # the def line and everything before it kept: the run starts after
    assert recall(~whole, info, max_tokens=1000)[0] == at(p, b"    b = a")


def test_a_quoted_path_names_its_code_shaped_parts_and_a_named_json_key_keeps_its_object():
    names = names_in("Read config/plant.json and tell me the value of `services.cursor_signal.ledger_max`.")
    assert {b"cursor_signal", b"ledger_max"} <= names and b"services" not in names
    doc = ('{\n  "services": {\n    "cursor_signal": {\n      "ledger_max": 25589,\n      "plume_mode": "cold"\n'
           '    },\n    "relay_kernel": {\n      "socket_ms": 7\n    }\n  }\n}\n')
    p = pieces(doc)
    mask = np.zeros(len(p), dtype=bool)
    mask[-1] = True
    text = kept_text(p, widen(mask, lines_of(p, frozenset({b"cursor_signal"})), whole_lines=True, blocks=False,
                              named=True))
    assert '"ledger_max": 25589' in text and '"plume_mode": "cold"' in text and "socket_ms" not in text


def test_focus_keeps_of_a_file_naming_a_def_only_the_named_block():
    """The scores kept another def's body (``class K``'s method); a request naming ``foo``
    keeps foo whole and the forced tokens, and drops that body, the other def and class lines
    and the constants."""
    p = pieces("".join(f"{i:>6}\t{x}" for i, x in enumerate(SOURCE, 1)))
    mask = np.zeros(len(p), dtype=bool)
    mask[at(p, b"pass")] = True
    forced = np.zeros(len(p), dtype=bool)
    forced[-1] = True
    named = lines_of(p, frozenset({b"foo"}))
    text = kept_text(p, focus(widen(mask, named, whole_lines=True, blocks=False, named=True), forced, named))
    for line in ("def foo(a):", "b = a", "return b"):
        assert line in text
    for line in ("pass", "class K:", "def m(self):", "x = 1", "y = 2"):
        assert line not in text
    assert text.endswith(kept_text(p, forced))
    unnamed = lines_of(p, frozenset({b"z"}))  # a named line that opens no block: the scores stand
    assert np.array_equal(focus(mask, forced, unnamed), mask)
