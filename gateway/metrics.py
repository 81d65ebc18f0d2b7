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


class Live(Collector):
    """Figures read at scrape time: ``gauges`` and ``counters`` map a name to (help, read)."""

    def __init__(self) -> None:
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}
        self.counters: dict[str, tuple[str, Callable[[], float]]] = {}

    def collect(self) -> Iterator[Metric]:
        for name, (help_, read) in sorted(self.gauges.items()):
            yield GaugeMetricFamily(name, help_, value=read())
        for name, (help_, read) in sorted(self.counters.items()):
            yield CounterMetricFamily(name, help_, value=read())


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
