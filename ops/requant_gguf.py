"""Write a copy of a GGUF model whose block weights are re-quantized to another type.

    .venv/bin/python ops/requant_gguf.py SRC.gguf DST.gguf Q4_0      # or Q8_0

A measurement aid (results/planner.md, "Where the speculator's time goes"); the server's
``--scorer speculator-q4_0`` writes and caches the same Q4_0 copy itself
(core.models.scorer_cuts).  Q8_0 keeps the values to 1/254 of a block's range; Q4_0
rounds the speculator's 5-bit weights to 4 bits, so it changes the model a little.
"""

from __future__ import annotations

import sys

from core.models.scorer_cuts import requantize_blocks

if __name__ == "__main__":
    requantize_blocks(sys.argv[1], sys.argv[2], sys.argv[3])
