"""Prometheus metrics through ``prometheus_client``, one registry per app.

Turn-level figures are counters and histograms updated as turns finish; state
that lives elsewhere (sessions, queue, parked KV, spill files, the store
writer) is read at scrape time by one custom collector, typed correctly:
totals as counters, levels as gauges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from core.results import Timings

TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)
CONTENT_TYPE = "text/plain; version=0.0.4"


# The session layer's figures (SessionManager.figures), by metric name: (figure, help).
GAUGES = {
    "specgate_live_sessions": ("sessions", "Sessions held in this process."),
    "specgate_implicit_sessions": ("implicit_sessions", "Sessions the server made for requests that name none."),
    "specgate_running_turns": ("running_turns", "Turns running or queued."),
    "specgate_queue_depth": ("queue_depth", "Turns queued for the model thread, plus the running ones."),
    "specgate_slots_busy": ("slots_busy", "Model slots running a turn."),
    "specgate_slots_resident": ("slots_resident", "Model slots holding a session's KV."),
    "specgate_step_last_batch_rows": ("last_batch_rows", "Decoding turns in the last batch of the step loop."),
    "specgate_kv_bytes_ram": ("kv_ram", "Parked session KV held in RAM."),
    "specgate_kv_bytes_disk": ("kv_disk", "Parked session KV spilled to disk."),
    "specgate_store_pending_writes": ("store_pending", "Session records waiting for the store."),
    "specgate_store_degraded": ("store_degraded", "1 while store writes are failing."),
    "specgate_kv_tier_bytes": ("tier_bytes", "Shared prefixes' KV kept in the KV tier's folder."),
}
COUNTERS = {
    "specgate_kv_evictions": ("kv_evictions", "Parked KV evicted from RAM."),
    "specgate_steps": ("steps", "Steps of the model thread's loop."),
    "specgate_prefix_hits": ("prefix_hits", "Sessions that started from a cached system prompt."),
    "specgate_prefix_misses": ("prefix_misses", "System prompts prefilled into the prefix cache."),
    "specgate_prefix_waits": ("prefix_waits", "Sessions that waited for another turn to cache their system prompt."),
    "specgate_prefix_adopted": ("prefix_adopted", "Sessions that started from an idle resident session's prefix KV."),
    "specgate_prefix_copied": ("prefix_copied", "System prompts cached by copying a resident session's KV, "
                               "not by prefilling them."),
    "specgate_prefix_completed": ("prefix_completed", "Cached system prompts given the scorer's part in idle "
                                  "time (copied while the scorer was deferred)."),
    "specgate_speculator_caught_up_tokens": ("caught_up", "Scorer tokens prefilled in idle time, so that a "
                                             "session's next turn scores only its new tokens."),
    "specgate_held_reply_rewritten_tokens": ("held_rewritten", "Target tokens prefilled in idle time to rewrite a "
                                             "reply that called tools in the form the client resends it."),
    "specgate_idle_chunks": ("idle_chunks", "Chunks of idle work the model thread ran between turns."),
    "specgate_checkpoints_lent": ("checkpoints_lent", "New conversations started from another conversation's "
                                  "checkpoint in the KV tier (no idle session here held their prefix)."),
    "specgate_kv_spliced_tokens": ("spliced", "Tokens moved into place from another conversation's KV (a block "
                                   "repeated after a different task) instead of prefilled."),
    "specgate_kv_tier_hits": ("tier_hits", "Prefixes restored from the KV tier instead of prefilled."),
    "specgate_kv_tier_writes": ("tier_writes", "Prefix entries written to the KV tier."),
    "specgate_kv_tier_rejected": ("tier_rejected", "KV tier files discarded by their checks (recomputed)."),
    "specgate_session_checkpoints": ("checkpoints_written",
                                     "Session KV checkpoints written to the KV tier in idle time."),
    "specgate_session_checkpoint_restores": ("checkpoints_restored", "Sessions rebuilt from their checkpoint "
                                             "in the KV tier (taken over, restarted or evicted) instead of prefilled."),
    "specgate_implicit_hits": ("implicit_hits", "Requests naming no session that continued a held conversation."),
    "specgate_implicit_misses": ("implicit_misses",
                                 "Requests naming no session that matched no idle held conversation."),
    "specgate_implicit_reused_tokens": ("implicit_reused", "Target tokens reused by turns of implicit sessions."),
    "specgate_step_batches": ("batches", "Batches decoded by the step loop."),
    "specgate_step_batch_rows": ("batch_rows",
                                 "Decoding turns' tokens over all batches (divide by batches: mean batch)."),
    "specgate_step_batch_tokens": ("batch_tokens", "Tokens over all batches (divide by batches: tokens per batch)."),
    "specgate_step_chunk_stalls": ("chunk_stalls",
                                   "Batches in which decoding turns shared the step with a prefill chunk."),
    "specgate_step_stall_tokens": ("stall_tokens",
                                   "Prefill tokens carried by those batches (divide by stalls: mean chunk)."),
    "specgate_spill_writes": ("spill_writes", "KV spill files written."),
    "specgate_spill_failures": ("spill_failures", "KV spill writes that failed (the session rebuilds)."),
    "specgate_spill_rejected": ("spill_rejected", "KV spill files discarded by their checks."),
    "specgate_store_errors": ("store_errors", "Failed metadata store writes (retried)."),
    "specgate_store_rejected_writes": ("store_rejected", "Record writes refused: another replica owns the session."),
    "specgate_store_dropped_writes": ("store_dropped", "Records dropped for an error that is not an outage (logged)."),
}


class Live(Collector):
    """Figures read at scrape time, all at once from ``read`` (none until it is set)."""

    def __init__(self) -> None:
        self.read: Callable[[], dict[str, float]] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.read is None:
            return
        figures = self.read()
        for name, (key, help_) in sorted(GAUGES.items()):
            yield GaugeMetricFamily(name, help_, value=figures[key])
        for name, (key, help_) in sorted(COUNTERS.items()):
            yield CounterMetricFamily(name, help_, value=figures[key])


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.live = Live()
        r.register(self.live)
        self.requests = Counter("specgate_requests", "HTTP/WS requests by route and status.",
                                ["route", "status"], registry=r)
        self.turns = Counter("specgate_turns", "Finished turns by outcome (completed, cancelled, failed).",
                             ["outcome"], registry=r)
        self.rejected = Counter("specgate_rejected", "Requests refused before a turn ran, by error code.",
                                ["code"], registry=r)
        self.disconnects = Counter("specgate_client_disconnects", "Clients that left before their reply.",
                                   ["transport"], registry=r)
        self.specprefill = Counter("specgate_specprefill", "Turns by SpecPrefill planner status.", ["status"],
                                   registry=r)
        self.prefill_tokens = Counter("specgate_target_prefill_tokens", "Tokens prefilled into the target.",
                                      ["mode"], registry=r)
        self.scored = Counter("specgate_speculator_scored_tokens", "Prompt tokens scored by the speculator.",
                              registry=r)
        self.rebuilds = Counter("specgate_kv_rebuilds", "Session KV rebuilt after eviction or restart.",
                                registry=r)
        self.decode_turns = Counter("specgate_decode_turns", "Turns by decoding mode.", ["mode"], registry=r)
        self.draft_tokens = Counter("specgate_draft_tokens", "Speculative draft tokens, drafted and accepted.",
                                    ["outcome"], registry=r)
        self.verify_cells = Counter("specgate_verify_kv_cells", "Target KV cells attended by speculative "
                                    "verification, and a dense verify's count.", ["kind"], registry=r)
        self.ttft = Histogram("specgate_ttft_seconds", "Time to first token.", buckets=TTFT_BUCKETS_S,
                              registry=r)
        self.kept_ratio = Histogram("specgate_kept_ratio", "Kept share of new prompt tokens per turn.",
                                    buckets=RATIO_BUCKETS, registry=r)

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def turn_ended(self, outcome: str) -> None:
        self.turns.labels(outcome).inc()

    def turn(self, t: Timings) -> None:
        self.specprefill.labels(t.specprefill).inc()
        self.ttft.observe(t.ttft_ms / 1000.0)
        self.prefill_tokens.labels("sparse" if t.prompt_n < t.new_n else "dense").inc(t.prompt_n)
        self.scored.inc(t.speculator_prefill_n)
        if t.new_n:
            self.kept_ratio.observe(t.prompt_n / t.new_n)
        if t.kv_rebuilt:
            self.rebuilds.inc()
        s = t.speculative
        self.decode_turns.labels(t.decode_mode).inc()
        self.draft_tokens.labels("drafted").inc(s.n_drafted)
        self.draft_tokens.labels("accepted").inc(s.n_accepted)
        self.verify_cells.labels("attended").inc(s.cells_attended)
        self.verify_cells.labels("total").inc(s.cells_total)

    def render(self) -> bytes:
        return generate_latest(self.registry)
