"""The tool-call guard: what of a prompt must stay dense (pure functions).

Agent prompts carry two kinds of text.  *Structure* -- the system prompt with
the tool definitions, the assistant messages that call tools, the chat
template's tokens around every message, the header of each tool result, and
the question being asked -- is what the model needs verbatim to call tools
and to know what is asked.  *Content* -- tool-result bodies (files, search
results, logs) and long user documents -- is where the length is, and is
sparsified like any long context.

Two modes (``PrefillPolicy.guard_mode``):

* ``structural`` keeps the structure dense and lets SpecPrefill select among
  the content.  A raw prompt (no message structure) keeps its head dense when
  the head reads like a tool spec.
* ``skip`` skips SpecPrefill for any prompt that defines or carries tools, or
  whose system prompt reads like a tool spec.

The keyword scan reads the system prompt and the tool definitions, never the
user's document; a raw prompt's first ``guard_scan_tokens`` tokens stand in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from core.policies import PrefillPolicy
from core.prompt import Prompt, Span

STRUCT_HEAD = 4  # "<|im_start|>role\n": the first span opens with its header
STRUCT_TAIL = 6  # "<|im_end|>\n<|im_start|>role\n": a message span ends with the next header


@dataclass(slots=True, frozen=True)
class GuardVerdict:
    triggered: bool  # tools, tool messages, a grammar or a tool-like system prompt
    reason: str = ""  # why it triggered
    spans: tuple[tuple[int, int], ...] = ()  # token spans the structural guard keeps dense
    kept: str = ""  # what those spans are, for the planner's reason


def keyword_hits(text: str, keywords: Sequence[str]) -> list[str]:
    lowered = text.lower()
    return [k for k in keywords if k.lower() in lowered]


def scan_spans(prompt: Prompt, scan_tokens: int) -> tuple[tuple[int, int], ...]:
    """Where the keyword scan reads: the system spans (system prompt, tool definitions),
    or for a raw prompt its first ``scan_tokens`` tokens."""
    if prompt.spans:
        return tuple((s.start, s.end) for s in prompt.spans if s.role == "system")
    return ((0, min(scan_tokens, len(prompt))),)


def triggers(prompt: Prompt, scanned_text: str, keywords: Sequence[str]) -> list[str]:
    reasons = []
    if prompt.has_tools:
        reasons.append("request defines tools")
    if prompt.has_grammar:
        reasons.append("request carries a grammar")
    if n_tool := sum(1 for s in prompt.spans if s.role == "tool"):
        reasons.append(f"{n_tool} tool-role message(s)")
    if hits := keyword_hits(scanned_text, keywords):
        where = "system prompt" if prompt.spans else "prompt head"
        reasons.append(f"{where} mentions {', '.join(hits[:4])}")
    return reasons


def _last_user(spans: Sequence[Span]) -> Span | None:
    return next((s for s in reversed(spans) if s.role == "user"), None)


def structure(prompt: Prompt, policy: PrefillPolicy) -> tuple[list[tuple[int, int]], str]:
    """Spans of a chat prompt that stay dense, and a description of them."""
    spans: list[tuple[int, int]] = []
    counts = {"system": 0, "calls": 0, "results": 0}
    last_user = _last_user(prompt.spans)
    for s in prompt.spans:
        if s.role == "system":
            spans.append((s.start, s.end))
            counts["system"] += s.end - s.start
        elif s.role == "assistant" and s.tool_calls:
            spans.append((s.start, s.end))
            counts["calls"] += 1
        elif s is last_user:
            keep = policy.guard_user_tokens
            spans += [(s.start, s.start + STRUCT_HEAD), (max(s.start, s.end - keep), s.end)]
        else:
            head = policy.guard_header_tokens if s.role == "tool" else STRUCT_HEAD
            spans += [(s.start, min(s.end, s.start + head)), (max(s.start, s.end - STRUCT_TAIL), s.end)]
            counts["results"] += s.role == "tool"
    if prompt.spans:
        spans.append((prompt.spans[-1].end, len(prompt)))  # the generation prompt
    parts = [f"system prompt and tool definitions ({counts['system']} tokens)"] if counts["system"] else []
    if counts["calls"]:
        parts.append(f"{counts['calls']} assistant tool call(s)")
    if counts["results"]:
        parts.append(f"{counts['results']} tool-result header(s)")
    if last_user is not None:
        parts.append("the latest user message" + (f" (its last {policy.guard_user_tokens} tokens)"
                                                  if last_user.end - last_user.start > policy.guard_user_tokens
                                                  else ""))
    parts.append("template tokens around every message")
    return [(a, b) for a, b in spans if b > a], ", ".join(parts)


def inspect(prompt: Prompt, scanned_text: str, policy: PrefillPolicy) -> GuardVerdict:
    """``scanned_text``: the detokenized :func:`scan_spans` of ``prompt``."""
    reasons = triggers(prompt, scanned_text, policy.guard_keywords)
    reason = "; ".join(reasons)
    if prompt.spans:
        spans, kept = structure(prompt, policy)
        return GuardVerdict(bool(reasons), reason, tuple(spans), kept)
    if not reasons:
        return GuardVerdict(False)
    # no message structure (raw prompt): the scanned head is what looks like a tool spec
    n_head = min(policy.guard_scan_tokens, len(prompt))
    return GuardVerdict(True, reason, ((0, n_head),), f"the first {n_head} tokens")
