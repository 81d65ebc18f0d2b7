"""One turn's request as it travels below the gateway: who asks, what to render, the
policies, where its text goes and how to stop it.

The gateway builds one per turn and hands it to the session layer, which runs it in
the step loop; nothing below calls back up.  It is rendered on the model thread
(tokenizing is llama.cpp work), or carries the prompt already rendered (a request
naming no session is rendered first, to find the conversation its tokens continue).
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from core.policies import TurnParams
from core.prompt import Prompt

if TYPE_CHECKING:  # llama.cpp's side: the gateway builds a TurnRequest without loading it
    from core.decoding.decode import OnText
    from core.engine import Engine


@dataclass(slots=True, frozen=True, eq=False)
class TurnRequest:
    owner: str  # the API key's owner id: whose sessions and shared prefixes the turn may use
    messages: tuple[dict[str, Any], ...]  # OpenAI chat form, what sessions store
    tools: tuple[dict[str, Any], ...] | None
    params: TurnParams
    cancel: threading.Event = field(default_factory=threading.Event)  # stops prefill between chunks, and decoding
    sink: OnText | None = None  # the model thread hands it each text piece; False back stops the turn
    prompt: Prompt | None = None  # already rendered
    checked: bool = False  # ``prompt`` was checked against the context when rendered: not checked again
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def render(self, engine: Engine) -> Prompt:
        """The prompt (model thread)."""
        if self.prompt is not None:
            return self.prompt
        return engine.chat.render_chat(self.messages, self.tools,
                                       has_grammar=self.params.sampling.constraint is not None)
