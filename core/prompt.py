"""A tokenized prompt with the structure the guard and the planner need."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Span:
    role: str
    start: int
    end: int


@dataclass(slots=True, frozen=True)
class Prompt:
    tokens: tuple[int, ...]
    spans: tuple[Span, ...] = ()
    has_tools: bool = False
    has_grammar: bool = False

    def __len__(self) -> int:
        return len(self.tokens)
