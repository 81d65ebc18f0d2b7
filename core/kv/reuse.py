"""A run of a new prompt that another sequence holds further on (pure python).

Two conversations of one agent share their system prompt, then differ in the task, then
often repeat a long block after it: Claude Code sends its environment note (~2K tokens) as a
second system message after the user's task.  The shared prefix is copied as is; the
repeated block is in the donor's cache too, at other positions (the tasks differ in length),
so it can be moved into place (SlotCells.splice) instead of prefilled.  llama-server's
``--cache-reuse`` shifts such runs only where the new prompt drops tokens, never where it
inserts them, so it prefills this block again.
"""

from __future__ import annotations

from collections.abc import Sequence

PROBE = 16  # tokens that locate a candidate run before it is followed to its end


def find_run(tokens: Sequence[int], start: int, donor: Sequence[int], donor_pos: Sequence[int],
             min_run: int, max_gap: int) -> tuple[int, int, int] | None:
    """``(k, j, n)``: ``tokens[k:k+n] == donor[j:j+n]`` with ``start <= k <= start + max_gap``,
    ``j >= start``, ``n >= min_run``, every donor token of it cached at its own position
    (``donor_pos[j+i] == j+i``: dense, not compacted); the first such ``k``, its longest
    run.  None when there is none."""
    if min_run < PROBE or len(tokens) - start < min_run:
        return None
    index: dict[tuple[int, ...], int] = {}
    for j in range(start, len(donor) - PROBE + 1):
        if donor_pos[j] == j:
            index.setdefault(tuple(donor[j:j + PROBE]), j)
    for k in range(start, min(start + max_gap, len(tokens) - min_run) + 1):
        found = index.get(tuple(tokens[k:k + PROBE]))
        if found is None:
            continue
        j, n = found, 0
        while k + n < len(tokens) and j + n < len(donor) and tokens[k + n] == donor[j + n] \
                and donor_pos[j + n] == j + n:
            n += 1
        if n >= min_run:
            return k, j, n
    return None
