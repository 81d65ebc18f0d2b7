"""The model worker: the one thread that touches the engine (and so llama.cpp).

The event loop hands it whole jobs, as llama.cpp's server hands tasks to its
slots through a queue; HTTP code never holds a context.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from core.config import EngineConfig
from core.engine import Engine
from core.errors import EngineError

T = TypeVar("T")


class ModelState(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


class ModelWorker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.state = ModelState.LOADING
        self.error: str | None = None
        self._engine: Engine | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specgate-model")

    async def start(self) -> None:
        try:
            self._engine = await asyncio.get_running_loop().run_in_executor(self._pool, Engine, self.config)
        except Exception as exc:
            self.state, self.error = ModelState.FAILED, str(exc)
            raise
        self.state = ModelState.READY

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the model thread, in a copy of the caller's context (so its
        log lines keep the request and session ids)."""
        engine = self._engine
        if engine is None:
            raise EngineError(f"the models are {self.state.value}: {self.error or 'not started'}")
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._pool, ctx.run, fn, engine)

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await asyncio.get_running_loop().run_in_executor(self._pool, engine.close)
        self._pool.shutdown(wait=True)
        self.state = ModelState.CLOSED
