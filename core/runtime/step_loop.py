"""The step loop: many turns on the model thread, one batch per context per step.

In the spirit of nano-vllm's ``LLMEngine.step()``::

    step():  resume the turns that asked for nothing (new ones, or between rounds)
             for each context: one batch = every decoding turn's next token
                                         + one chunk of one pending prefill
             decode it, and resume each turn whose request is complete

A turn resumed after its decode samples its token at once (from its own batch
index) and streams it, so every decoding session gets a token per step.

Prefill: while any turn is streaming, a pending prefill gets a chunk sized by
:class:`core.runtime.chunk_budget.ChunkBudget`: at most ``step_tokens``, and with a
``prefill_share`` no more than that share of what the step costs without it,
so the streams slow by a bounded factor while the prefill keeps moving.
``step_tokens=0`` is *decode first*: no prefill at all until the decoders
drain.  With no turn streaming, a chunk is a whole ``n_batch`` (full speed).
The chunk goes to the prefill with the fewest tokens left on even steps (a
short prompt is not stuck behind a long one, and equal prompts finish one
after another instead of all late) and to the turn that arrived first on odd
steps (a long prompt is not starved by agents that keep sending short turns).

A turn that yields a :class:`Wait` sits out the batches until it is ready.  A
turn whose ``abort`` says so is cancelled before its next prefill chunk, or
while it waits (:class:`TurnCancelled`).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from core.errors import TurnCancelled
from core.runtime.chunk_budget import ChunkBudget
from core.steps import Tokens, TurnSteps, Wait

if TYPE_CHECKING:  # contexts are llama.cpp's: only the model thread makes them
    from core.llama.context import Context

log = structlog.get_logger("specgate.prefill")


@dataclass(slots=True, eq=False)
class Job:
    """A turn in the loop and where it stands."""

    turn: TurnSteps[Any]
    future: concurrent.futures.Future[Any]
    abort: Callable[[], bool] | None = None
    request: Tokens | Wait | None = None  # what it waits for; None: resume it at the next step
    done: int = 0  # tokens of ``request`` already decoded
    last_chunk: int = -1  # the step that last gave it a prefill chunk
    arrival: int = 0  # the order it joined the loop in
    context: contextvars.Context | None = None  # the request's log context (its ids)
    started: float = 0.0  # when ``request`` was made
    reported: float = 0.0  # when its progress was last logged

    @property
    def remaining(self) -> int:
        return len(self.request.tokens) - self.done if isinstance(self.request, Tokens) else 0

    @property
    def aborted(self) -> bool:
        return self.abort is not None and self.abort()


@dataclass(slots=True)
class StepStats:
    """Counters the metrics exporter reads (written on the model thread only)."""

    steps: int = 0
    batches: int = 0
    batch_rows: int = 0  # decoding turns' tokens, summed over batches
    batch_tokens: int = 0
    chunk_stalls: int = 0  # batches where decoding turns waited on a prefill chunk
    stall_tokens: int = 0  # the prefill tokens those chunks carried
    last_rows: int = 0
    busy_s: float = 0.0
    rows_hist: dict[int, int] = field(default_factory=dict)
    idle_chunks: int = 0  # chunks of idle work (core.runtime.worker)
    max_idle_chunks_ahead: int = 0  # the most idle chunks a queued turn or call waited behind


class StepLoop:
    def __init__(self, step_tokens: int, prefill_share: float = 0.0, progress_s: float = 10.0) -> None:
        self.progress_s = progress_s  # a long prefill logs where it is this often
        self.budget = ChunkBudget(step_tokens, prefill_share)  # its cost function: the engine's (core.runtime.worker)
        self.jobs: list[Job] = []
        self.stats = StepStats()
        self._chunk_s = 0.0  # the expected cost of this step's chunks
        self._arrivals = 0

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    def add(self, job: Job) -> None:
        job.started = job.reported = time.perf_counter()
        self._arrivals += 1
        job.arrival = self._arrivals
        self.jobs.append(job)

    def step(self) -> None:
        t0 = time.perf_counter()
        self.stats.steps += 1
        for job in [j for j in self.jobs if not isinstance(j.request, Tokens)]:
            wait = job.request
            if isinstance(wait, Wait) and job.aborted:
                self._throw(job, TurnCancelled("the turn was cancelled while it waited"))
            elif not isinstance(wait, Wait) or wait.ready():
                self._resume(job, None)
        requests = {j: j.request for j in self.jobs if isinstance(j.request, Tokens)}
        contexts: list[Context] = []
        for req in requests.values():
            if req.seq.ctx not in contexts:
                contexts.append(req.seq.ctx)
        # while some turn waits for its next token, prefill gets a bounded chunk (the budget's)
        streaming = any(j.remaining == 1 or j.request is None for j in self.jobs)
        self._chunk_s = 0.0
        for ctx in contexts:
            self._batch(ctx, [j for j, req in requests.items() if req.seq.ctx is ctx], streaming)
        elapsed = time.perf_counter() - t0
        if streaming:
            self.budget.observe(elapsed, self._chunk_s)
        self.stats.busy_s += elapsed

    def _batch(self, ctx: Context, jobs: list[Job], streaming: bool) -> None:
        decoding = [j for j in jobs if j.remaining == 1]
        prefilling = [j for j in jobs if j.remaining > 1]
        chunk: tuple[Job, int] | None = None
        fifo = self.stats.steps % 2 == 1
        for job in sorted(prefilling, key=lambda j: j.arrival if fifo else (j.remaining, j.last_chunk)):
            if job.aborted:
                self._throw(job, TurnCancelled("the turn was cancelled during prefill"))
                continue
            if chunk is None:
                pos = job.request.start_pos + job.done  # type: ignore[union-attr]
                limit = self.budget.tokens(ctx, pos) if streaming else ctx.n_batch
                n = min(limit, ctx.n_batch - len(decoding), job.remaining)
                if n > 0:
                    chunk = (job, n)
                    job.last_chunk = self.stats.steps
                    self._chunk_s += self.budget.chunk_s(ctx, n, pos) if streaming else 0.0
        parts = [(j, 1) for j in decoding] + ([chunk] if chunk else [])
        if not parts:
            return
        parts.sort(key=lambda p: p[0].request.seq.id)  # type: ignore[union-attr]
        rows = []
        for job, n in parts:
            req = job.request
            assert isinstance(req, Tokens)
            final = job.done + n == len(req.tokens)
            rows.append((req.seq.id, req.tokens[job.done: job.done + n], req.start_pos + job.done,
                         req.logits and final))
        try:
            last = ctx.decode_rows(rows)
        except Exception as exc:
            for job, _ in parts:
                self._throw(job, exc)
            return
        self._count(len(decoding), sum(n for _, n in parts), chunk[1] if chunk else 0)
        finished = []
        for (job, n), idx in zip(parts, last, strict=True):
            job.done += n
            if job.remaining > 0 and n > 1:
                self._progress(job)
            if job.remaining == 0:
                finished.append((job, idx))
        # decoding turns sample first: a resumed turn may decode inline and overwrite the logits
        finished.sort(key=lambda f: f[0] not in decoding)
        for job, idx in finished:
            self._resume(job, idx)

    def _count(self, rows: int, tokens: int, chunk: int) -> None:
        s = self.stats
        s.batches += 1
        s.batch_rows += rows
        s.batch_tokens += tokens
        s.last_rows = rows
        s.rows_hist[rows] = s.rows_hist.get(rows, 0) + 1
        if chunk and rows:
            s.chunk_stalls += 1
            s.stall_tokens += chunk

    def _progress(self, job: Job) -> None:
        """Log a long prefill's progress every ``progress_s`` (ops see it move, not minutes
        of silence between ``request_start`` and ``turn_done``)."""
        now = time.perf_counter()
        if now - job.reported < self.progress_s or not isinstance(job.request, Tokens):
            return
        job.reported = now
        rate = job.done / max(now - job.started, 1e-9)
        fields = {"model": job.request.seq.ctx.model.path.name, "done": job.done, "total": len(job.request.tokens),
                  "tokens_per_s": round(rate, 1), "eta_s": round(job.remaining / rate, 1) if rate else None}
        (job.context or contextvars.Context()).run(log.info, "prefill_progress", **fields)

    def _resume(self, job: Job, reply: int | None) -> None:
        job.request, job.done = None, 0
        try:
            request = job.turn.send(reply)
        except StopIteration as stop:
            self._finish(job, result=stop.value)
        except BaseException as exc:  # noqa: BLE001 -- delivered to the waiting request
            self._finish(job, error=exc)
        else:
            job.request = request
            job.started = job.reported = time.perf_counter()

    def _throw(self, job: Job, exc: BaseException) -> None:
        job.request, job.done = None, 0
        try:
            request = job.turn.throw(exc)
        except StopIteration as stop:
            self._finish(job, result=stop.value)
        except BaseException as err:  # noqa: BLE001
            self._finish(job, error=err)
        else:
            job.request = request
            job.started = job.reported = time.perf_counter()

    def _finish(self, job: Job, result: Any = None, error: BaseException | None = None) -> None:
        self.jobs.remove(job)
        if job.future.cancelled():
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def cancel_all(self, reason: str) -> None:
        """Shutdown: every turn still in the loop ends with :class:`TurnCancelled`."""
        for job in list(self.jobs):
            self._throw(job, TurnCancelled(reason))
        for job in list(self.jobs):  # a turn that caught it and asked for more
            job.turn.close()
            self._finish(job, error=TurnCancelled(reason))
