"""A tokenized prompt with the structure the guard and the planner need."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Span:
    """One message's tokens, the template's tokens around it included."""

    role: str
    start: int
    end: int
    tool_calls: bool = False  # an assistant message that calls tools


@dataclass(slots=True, frozen=True)
class Prompt:
    tokens: tuple[int, ...]
    spans: tuple[Span, ...] = ()
    has_tools: bool = False
    has_grammar: bool = False

    def __len__(self) -> int:
        return len(self.tokens)
