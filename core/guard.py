"""The tool-call guard: prompts that define or carry tools are not sparsified blindly.

It fires on tools or a grammar in the request, on tool-role messages, and on
tool/function keywords in the detokenized head of the prompt.  What happens
next (skip, or keep the system prompt and tool spans dense) is the planner's
call, driven by ``PolicyConfig.guard_mode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from core.prompt import Prompt


@dataclass(slots=True, frozen=True)
class GuardVerdict:
    triggered: bool
    reason: str = ""
    spans: tuple[tuple[int, int], ...] = ()  # token spans to keep dense if guarded


def keyword_hits(head_text: str, keywords: Sequence[str]) -> list[str]:
    lowered = head_text.lower()
    return [k for k in keywords if k.lower() in lowered]


def inspect(prompt: Prompt, head_text: str, n_head: int, keywords: Sequence[str]) -> GuardVerdict:
    """``head_text``: the first ``n_head`` tokens of the prompt, detokenized."""
    protected = tuple((s.start, s.end) for s in prompt.spans if s.role in ("system", "tool"))
    reasons = []
    if prompt.has_tools:
        reasons.append("request defines tools")
    if prompt.has_grammar:
        reasons.append("request carries a grammar")
    tool_spans = [s for s in prompt.spans if s.role == "tool"]
    if tool_spans:
        reasons.append(f"{len(tool_spans)} tool-role message(s)")
    hits = keyword_hits(head_text, keywords)
    if hits:
        reasons.append(f"prompt head mentions {', '.join(hits[:4])}")
    if not reasons:
        return GuardVerdict(False)
    if not protected and hits:
        # no message structure (raw prompt): the scanned head is what looks like a tool spec
        protected = ((0, n_head),)
    return GuardVerdict(True, "; ".join(reasons), protected)
