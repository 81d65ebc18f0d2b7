"""What kind of content a prompt's selectable tokens are (pure): source code, logs or
prose.  SpecPrefill keeps a different share of each (measured on the real pair: logs
9-15%, source code 28-39%), so break-even predicts the kept share per kind
(core.specprefill.cost_model.Costs) instead of from an average over other prompts."""

from __future__ import annotations

import enum
import re


class ContentKind(enum.StrEnum):
    CODE = "code"
    LOGS = "logs"
    PROSE = "prose"


# a log line starts with a timestamp, a date or a level
_LOG_LINE = re.compile(r"^\s*(\[?\d{4}-\d\d-\d\d|\[?\d\d:\d\d:\d\d|\[?(TRACE|DEBUG|INFO|WARN|WARNING|ERROR|FATAL)\b)")
# a code line ends in a bracket or a statement end, or starts with a keyword or an indented statement
_CODE_LINE = re.compile(r"([{}()\[\];:,]\s*$)|^\s*((def|class|return|import|from|if|elif|else|for|while|try|"
                        r"except|with|function|const|let|var|fn|pub|use|public|private|static|struct|async|await)\b"
                        r"|@\w|#|//|/\*)")
LINE_SHARE = 0.3  # of non-empty lines, for a kind to be called
SAMPLE_LINES = 400


def content_kind(text: str) -> ContentKind:
    """The kind whose lines make up the larger share of ``text`` (at least
    ``LINE_SHARE`` of its non-empty lines, read evenly through it), else prose."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return ContentKind.PROSE
    step = max(1, len(lines) // SAMPLE_LINES)
    sample = lines[::step]
    logs = sum(bool(_LOG_LINE.match(line)) for line in sample) / len(sample)
    code = sum(bool(_CODE_LINE.search(line)) for line in sample) / len(sample)
    if max(logs, code) < LINE_SHARE:
        return ContentKind.PROSE
    return ContentKind.LOGS if logs >= code else ContentKind.CODE
