"""Prometheus text-format metrics, kept in-process (no client library needed)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from core.results import Timings

TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.total += value
        self.n += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def render(self, name: str) -> list[str]:
        lines = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)]
        lines += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return lines


class Metrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.specprefill_status: dict[str, int] = defaultdict(int)
        self.prefill_tokens: dict[str, int] = defaultdict(int)  # dense | sparse
        self.speculator_tokens_scored = 0
        self.rebuilds = 0
        self.store_errors = 0
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.kept_ratio = Histogram(RATIO_BUCKETS)
        self.gauges: dict[str, Callable[[], float]] = {}
        self.decode_turns: dict[str, int] = defaultdict(int)  # plain | speculative | specattn
        self.draft_tokens = {"drafted": 0, "accepted": 0}
        self.verify_cells = {"attended": 0, "total": 0}

    def request(self, route: str, status: int) -> None:
        self.requests[(route, status)] += 1

    def turn(self, t: Timings) -> None:
        self.specprefill_status[t.specprefill] += 1
        self.ttft.observe(t.ttft_ms / 1000.0)
        self.prefill_tokens["sparse" if t.prompt_n < t.new_n else "dense"] += t.prompt_n
        self.speculator_tokens_scored += t.speculator_prefill_n
        if t.new_n:
            self.kept_ratio.observe(t.prompt_n / t.new_n)
        self.rebuilds += int(t.kv_rebuilt)
        s = t.speculative
        self.decode_turns[t.decode_mode] += 1
        self.draft_tokens["drafted"] += s.n_drafted
        self.draft_tokens["accepted"] += s.n_accepted
        self.verify_cells["attended"] += s.cells_attended
        self.verify_cells["total"] += s.cells_total

    def render(self) -> str:
        out: list[str] = []

        def block(name: str, kind: str, help_: str, lines: list[str]) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines])

        block("specgate_requests_total", "counter", "HTTP/WS requests by route and status.",
              [f'specgate_requests_total{{route="{r}",status="{s}"}} {n}'
               for (r, s), n in sorted(self.requests.items())])
        block("specgate_specprefill_total", "counter", "Turns by SpecPrefill planner status.",
              [f'specgate_specprefill_total{{status="{s}"}} {n}' for s, n in sorted(self.specprefill_status.items())])
        block("specgate_target_prefill_tokens_total", "counter", "Tokens prefilled into the target.",
              [f'specgate_target_prefill_tokens_total{{mode="{m}"}} {self.prefill_tokens[m]}'
               for m in ("dense", "sparse")])
        block("specgate_speculator_scored_tokens_total", "counter", "Prompt tokens scored by the speculator.",
              [f"specgate_speculator_scored_tokens_total {self.speculator_tokens_scored}"])
        block("specgate_kv_rebuilds_total", "counter", "Session KV rebuilt after eviction.",
              [f"specgate_kv_rebuilds_total {self.rebuilds}"])
        block("specgate_store_errors_total", "counter", "Failed metadata store writes.",
              [f"specgate_store_errors_total {self.store_errors}"])
        block("specgate_decode_turns_total", "counter", "Turns by decoding mode.",
              [f'specgate_decode_turns_total{{mode="{m}"}} {n}' for m, n in sorted(self.decode_turns.items())])
        block("specgate_draft_tokens_total", "counter", "Speculative draft tokens, drafted and accepted.",
              [f'specgate_draft_tokens_total{{outcome="{k}"}} {n}' for k, n in self.draft_tokens.items()])
        block("specgate_verify_kv_cells_total", "counter",
              "Target KV cells attended by speculative verification, and a dense verify's count.",
              [f'specgate_verify_kv_cells_total{{kind="{k}"}} {n}' for k, n in self.verify_cells.items()])
        block("specgate_ttft_seconds", "histogram", "Time to first token.", self.ttft.render("specgate_ttft_seconds"))
        block("specgate_kept_ratio", "histogram", "Kept share of new prompt tokens per turn.",
              self.kept_ratio.render("specgate_kept_ratio"))
        for name, fn in sorted(self.gauges.items()):
            block(name, "gauge", name.replace("_", " "), [f"{name} {fn()}"])
        return "\n".join(out) + "\n"
