"""What machine this is, as measurements record it."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cpu_name() -> str:
    """The CPU's model name and core count: what a speed measurement is valid for."""
    return f"{cpu_model()} x{os.cpu_count()}"
