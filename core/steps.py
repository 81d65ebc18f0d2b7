"""What a turn asks of the step loop, and how a turn runs alone.

A turn is a generator on the model thread (:meth:`core.engine.Engine.turn`).
Whenever it needs tokens decoded into one of its sequences it yields a
:class:`Tokens` request and is resumed with the batch index of the request's
last token (whose logits it may then sample).  Everything else it does inline.
A bare ``yield None`` just gives the other turns a step (a turn that decodes
unbatched, e.g. speculative decoding, yields so between rounds).  A
:class:`Wait` sets the turn aside until another turn has made something ready
(a shared prefix being built); a waiting turn is not streaming, so it never
holds a prefill back.

:func:`drive` runs one turn by itself, each request as its own decode; the step
loop (core.runtime.step_loop) runs many, batching their requests.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from core.errors import EngineError

if TYPE_CHECKING:  # pure: the unit tests import this without llama.cpp
    from core.llama.context import Seq

R = TypeVar("R")


@dataclass(slots=True)
class Tokens:
    """Decode ``tokens`` into ``seq`` at positions ``start_pos``..; ``logits``: keep the
    last token's logits.  Many tokens are a prefill, which the loop may chunk."""

    seq: Seq
    tokens: Sequence[int]
    start_pos: int
    logits: bool = True


@dataclass(slots=True)
class Wait:
    """Resume the turn once ``ready()`` is true."""

    ready: Callable[[], bool]


TurnSteps = Generator["Tokens | Wait | None", "int | None", R]


def drive(turn: TurnSteps[R]) -> R:
    """Run ``turn`` alone to its result."""
    reply: int | None = None
    while True:
        try:
            req = turn.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = None
        if isinstance(req, Wait):
            if not req.ready():  # nothing else runs here that could make it ready
                raise EngineError("a turn running alone waits on another turn")
        elif req is not None:
            req.seq.decode(req.tokens, req.start_pos, logits_last=req.logits)
            reply = -1
