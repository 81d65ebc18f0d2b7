"""Real local texts for calibration and perplexity (no hub is reachable here).

Python's own standard library sources (code with docstrings) exist wherever
SpecGate runs; the Debian license texts (English prose) exist on Debian and
Ubuntu machines such as this one and CI.  Both are surely in the models'
training data (GPL-3 scores a perplexity near 1.3 at its start), so the
evaluation also scores ``core/texts/specprefill_guide.txt`` (shipped with the
package), the SpecPrefill implementation guide this project was built from,
which no model has seen.  Calibration and
evaluation use different documents.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from core.errors import ConfigError

LICENSES = Path("/usr/share/common-licenses")
CALIBRATION = ("stdlib:textwrap.py", "license:Apache-2.0", "stdlib:difflib.py", "license:LGPL-2.1")
EVALUATION = ("package:specprefill_guide.txt", "license:GPL-3")
TEXTS = Path(__file__).resolve().parent / "texts"


def path_of(name: str) -> Path:
    kind, _, rest = name.partition(":")
    if kind == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"]) / rest
    if kind == "license":
        return LICENSES / rest
    if kind == "package":
        return TEXTS / rest
    return Path(name)


def read(name: str) -> str:
    path = path_of(name)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"text {name!r} unavailable at {path}: {exc.strerror}") from exc


def available(names: tuple[str, ...]) -> list[str]:
    return [n for n in names if path_of(n).is_file()]
