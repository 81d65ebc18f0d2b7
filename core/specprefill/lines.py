"""A selection widened to the lines and code blocks it touches (pure numpy).

Coding agents copy from their tool results: an ``Edit``'s ``old_string`` must match the file
byte for byte, a line number feeds the next ``Read``.  Chunks of 32 tokens cut lines in two,
and a function whose ``def`` line the scorer found is of no use without its body.  So, for
line-oriented content:

- **whole lines**: a line any of whose tokens is kept is kept whole;
- **code blocks**: a kept line that opens a block (``def``, ``async def``, ``class``, or a
  line ending with ``{`` or ``[``) keeps the lines indented under it, up to ``max_block_lines``;
- **the code's skeleton**: in source code, the top-level imports, decorators and assignments
  (constants) and every ``def`` and ``class`` line, kept whatever the scores: what a later
  question about the file needs first (a constant's value, where a name is defined, with the
  ``cat -n`` number in front of it), and what a kept block hangs from;
- **named lines**: a line that holds an identifier the turn's request names (the last user
  message and the tool calls after it: ``parse_header``, ``MAX_RETRIES``, a name in
  backticks, and a quoted path's parts) is kept whatever its scores, and a named line that opens a
  block (``def``, ``class``, a JSON key or literal ending with ``{`` or ``[``) keeps it:
  the speculator's lookahead sees the end of the prompt, often far from the question, and the
  lines a request names are the ones its answer copies.

Only lines of at most ``max_line_tokens`` tokens are widened or forced: a one-line JSON tool
result or an unwrapped paragraph is a "line" of thousands of tokens, and keeping it whole would
keep everything; there the scored chunks stand as they are.

Lines come from the tokens' bytes (a token that ends with or holds a newline closes its
line); ``cat -n``'s line numbers (``   12\\t``), as ``Read`` returns files, are looked past
for indentation.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.spans import runs

NUMBERED = re.compile(rb"^\s*\d+\t")  # cat -n / Read: the line number and a tab
OPENS = (b"def ", b"async def ", b"class ")
TOP_LEVEL = re.compile(rb"^(import |from |@|[A-Za-z_][A-Za-z0-9_]*\s*(:[^=]*)?=[^=])")  # imports, decorators, names
WORD = re.compile(r"`([^`\s]{2,64})`|([A-Za-z_][A-Za-z0-9_]{2,63})")
PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]{1,63}")
MAX_NAMES = 32
BRACES = (b"{", b"[")  # a line ending with one opens a block: a JSON or JS object, a list or dict literal


@dataclass(slots=True, frozen=True)
class Lines:
    of_token: np.ndarray  # int64: the line each token belongs to
    indent: np.ndarray  # int64 per line: leading spaces after any line number; -1 for a blank line
    opens: np.ndarray  # bool per line: it opens a block (def, class, or a line ending with { or [)
    skeleton: np.ndarray  # bool per line: a def or class line, or a top-level import, decorator or assignment
    named: np.ndarray  # bool per line: it holds one of the names looked for
    n_tokens: np.ndarray  # int64 per line: the tokens that start in it

    def short(self, max_tokens: int) -> np.ndarray:
        """Per line: at most ``max_tokens`` tokens long (0: every line)."""
        return self.n_tokens <= max_tokens if max_tokens > 0 else np.ones(len(self.n_tokens), dtype=bool)


def names_in(text: str) -> frozenset[bytes]:
    """The identifiers a request names: words in backticks, and words shaped like code
    (``snake_case``, ``CONSTANT_CASE``, ``camelCase``, with a digit); plain English words are
    not names, so "the function" keeps no line that says "function"."""
    found: list[bytes] = []
    for quoted, word in WORD.findall(text):
        if quoted or _code_shaped(word):
            found.append((quoted or word).encode())
        if quoted:  # a quoted path (`services.cache_pool.ttl_ms`) names its code-shaped parts: lines hold those
            found += [part.encode() for part in PART.findall(quoted) if part != quoted and _code_shaped(part)]
    return frozenset(list(dict.fromkeys(found))[:MAX_NAMES])


def _code_shaped(word: str) -> bool:
    return "_" in word.strip("_") or any(c.isdigit() for c in word) or any(c.isupper() for c in word[1:])


def lines_of(pieces: Sequence[bytes], names: frozenset[bytes] = frozenset()) -> Lines:
    """The lines of a token sequence whose pieces (the tokens' bytes) are ``pieces``, and
    which of them hold one of ``names`` as a whole word."""
    newlines = np.fromiter((p.count(b"\n") for p in pieces), dtype=np.int64, count=len(pieces))
    ends = np.cumsum(newlines)
    of_token = ends - newlines  # a token belongs to the line it starts in
    text = b"".join(pieces).split(b"\n")
    indent = np.full(len(text), -1, dtype=np.int64)
    opens = np.zeros(len(text), dtype=bool)
    skeleton = np.zeros(len(text), dtype=bool)
    named = np.zeros(len(text), dtype=bool)
    pattern = _word_pattern(names)
    for i, raw in enumerate(text):
        line = NUMBERED.sub(b"", raw, count=1)
        body = line.lstrip(b" ")
        if body.strip():
            indent[i] = len(line) - len(body)
            defines = body.startswith(OPENS)
            opens[i] = defines or body.rstrip().endswith(BRACES)
            skeleton[i] = defines or (indent[i] == 0 and TOP_LEVEL.match(body) is not None)
            named[i] = pattern is not None and pattern.search(body) is not None
    n_tokens = np.bincount(of_token, minlength=len(text)).astype(np.int64)
    return Lines(of_token, indent, opens, skeleton, named, n_tokens)


def _word_pattern(names: frozenset[bytes]) -> re.Pattern[bytes] | None:
    if not names:
        return None
    alternatives = b"|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(rb"(?<![A-Za-z0-9_])(?:" + alternatives + rb")(?![A-Za-z0-9_])")


def widen(kept: np.ndarray, lines: Lines, whole_lines: bool, blocks: bool, max_block_lines: int = 80,
          skeleton: bool = False, named: bool = False, max_line_tokens: int = 0) -> np.ndarray:
    """``kept`` (a boolean mask over the tokens) with the lines and blocks it touches, with
    ``skeleton`` the code's skeleton (source code only: elsewhere every line is top-level),
    and with ``named`` the named lines and the blocks a named line opens; lines longer than
    ``max_line_tokens`` (0: no bound) are neither widened nor added."""
    named = named and bool(lines.named.any())
    if not (whole_lines or blocks or skeleton or named) or not kept.any():
        return kept
    short = lines.short(max_line_tokens)
    line_kept = np.zeros(len(lines.indent), dtype=bool)
    line_kept[np.unique(lines.of_token[kept])] = True
    if blocks:  # the blocks the scores chose: the skeleton's def lines open none
        line_kept |= _blocks(line_kept, lines, max_block_lines)
    if named:
        named_lines = named_with_blocks(lines, max_block_lines, max_line_tokens)
        line_kept |= named_lines
        kept = kept | named_lines[lines.of_token]  # whole, even where lines are not widened
    if skeleton:
        kept = kept | (lines.skeleton & short)[lines.of_token]
        line_kept |= lines.skeleton
    widened = (line_kept & short)[lines.of_token]
    return kept | widened if whole_lines else kept | (widened & ~_touched(kept, lines))


def named_with_blocks(lines: Lines, max_block_lines: int = 80, max_line_tokens: int = 0) -> np.ndarray:
    """Per line: it holds a name looked for, or lies in the block a named ``def`` or
    ``class`` line opens; lines longer than ``max_line_tokens`` (0: no bound) are not."""
    return (lines.named | _blocks(lines.named, lines, max_block_lines)) & lines.short(max_line_tokens)


def focus(kept: np.ndarray, forced: np.ndarray, lines: Lines, max_line_tokens: int = 0,
          max_block_lines: int = 80) -> np.ndarray:
    """``kept`` narrowed, where a named line opens a block (the request names a function the file
    defines), to the ``forced`` tokens and the named lines and blocks: nothing else of the file.
    Asked to copy a named function with the named block whole in its context, the 1.5B wrote
    another def or class line over its body when other code of the file stayed -- kept after
    the block by the scores, or before it by the skeleton -- and copied it when nothing else
    did (ops/copy_probe.py, two seeds; results/depth.md, "What surrounds a named block").  A
    later question about the rest of the file names what it needs, and recall brings it back.
    Elsewhere ``kept`` is returned as it is."""
    if not (lines.named & lines.opens).any():
        return kept
    return forced | named_with_blocks(lines, max_block_lines, max_line_tokens)[lines.of_token]


def recall(dropped: np.ndarray, lines: Lines, max_tokens: int, max_block_lines: int = 80,
           max_line_tokens: int = 0) -> np.ndarray:
    """The tokens of earlier turns to prefill again into the target's cache: on each stretch
    of lines the request names (a named line, a named ``def``'s block), those from the first
    token a sparse prefill dropped (``dropped``, a boolean mask over the history) to the last,
    the kept ones between included.  A later question about a file read turns ago ("now copy
    ``other_function``") needs lines no earlier request named, and the scorer never saw it.
    One run per stretch, because a recalled run attends only to the cells before its first
    token: a body line kept between two recalled runs would be out of the second run's sight,
    and the copied body came back with that line skipped or swapped (issue 52).
    Indices, ascending; the newest ``max_tokens`` of them when there are more."""
    named = named_with_blocks(lines, max_block_lines, max_line_tokens)[lines.of_token]
    wanted = np.zeros(len(dropped), dtype=bool)
    for a, b in runs(np.flatnonzero(named)):
        inside = np.flatnonzero(dropped[a:b])
        if inside.size:
            wanted[a + inside[0]:a + inside[-1] + 1] = True
    found = np.flatnonzero(wanted)
    return found[-max_tokens:] if max_tokens > 0 else found[:0]


def _touched(kept: np.ndarray, lines: Lines) -> np.ndarray:
    """Tokens on lines that ``kept`` already touches (left as the selection chose them when
    lines are not widened whole: only blocks' other lines are added)."""
    touched = np.zeros(len(lines.indent), dtype=bool)
    touched[np.unique(lines.of_token[kept])] = True
    return touched[lines.of_token]


def _blocks(line_kept: np.ndarray, lines: Lines, limit: int) -> np.ndarray:
    out = np.zeros_like(line_kept)
    n = len(lines.indent)
    for head in np.flatnonzero(line_kept & lines.opens):
        depth, end = lines.indent[head], head + 1
        while end < n and end - head <= limit and (lines.indent[end] < 0 or lines.indent[end] > depth):
            end += 1
        out[head:end] = True
    return out
