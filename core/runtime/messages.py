"""What the event loop may ask of the model thread: plain data, never a callable.

Each message names its work; the worker (core.runtime.worker) calls its own parts for it
(seating, idle work, the engine), as llama.cpp's server turns one ``server_task`` into slot
work.  So a request can be followed from the gateway to the engine and back with no
closure crossing the wall between the event loop and the model thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from core.kv.stores import Holder
from core.turn_request import TurnRequest


@dataclass(slots=True, frozen=True)
class RunTurn:
    """Run ``request`` in the step loop, in ``session`` (claimed by the caller) or, with
    none, in a slot of its own that is emptied after.  Answered with a ``TurnOutcome``."""

    request: TurnRequest
    session: Holder | None = None


@dataclass(slots=True, frozen=True)
class Render:
    """Render ``request``'s prompt and, with ``check``, check it against the context
    (``PromptTooLong``, ``EmptyPrompt``).  Answered with the ``Prompt``."""

    request: TurnRequest
    check: bool = True


@dataclass(slots=True, frozen=True)
class Forget:
    """Drop ``session``'s KV, resident or parked (and a deleted one's checkpoint)."""

    session: Holder


@dataclass(slots=True, frozen=True)
class Settle:
    """Drain: do what idle work still owes the KV tier before ``deadline``
    (``time.monotonic()``).  Answered with (entries queued, entries left)."""

    deadline: float


class Describe(enum.StrEnum):
    """What the session layer reads of the loaded models."""

    STATE_LAYOUT = "state_layout"  # the saved-state layout, for the KV stores' fingerprint
    LAYER_MAP = "layer_map"


@dataclass(slots=True, frozen=True)
class Wake:
    """Nothing to do: idle work looks again (a session just became idle)."""


Call = Render | Settle | Describe
Post = Forget | Wake
