"""PNG plots of the benchmark and eval results (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def first_turn(summary: list[dict[str, Any]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    n = [r["context_n"] for r in summary]
    ax.plot(n, [r["dense_ttft_ms"] / 1e3 for r in summary], "o-", label="dense prefill")
    ax.plot(n, [r["original_ttft_ms"] / 1e3 for r in summary], "s-", label="SpecPrefill, original positions")
    ax.plot(n, [r["compact_ttft_ms"] / 1e3 for r in summary], "^-", label="SpecPrefill, compact positions")
    for r in summary:
        ax.annotate(f"{r['compact_speedup']:.2f}x", (r["context_n"], r["compact_ttft_ms"] / 1e3),
                    textcoords="offset points", xytext=(4, -12), fontsize=8)
    _finish(fig, ax, out, "prompt tokens", "TTFT (s)",
            "First-turn TTFT, Qwen2.5-Coder 1.5B target / 0.5B speculator, 2 CPU cores")


def constrained(summary: dict[str, Any], out: Path) -> None:
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.2))
    arms = list(summary["serving"])
    tps = [summary["serving"][a]["tokens_per_s_median"] or 0 for a in arms]
    ax.bar(arms, tps, color=["grey" if summary["serving"][a]["valid"] is None else "tab:blue" for a in arms])
    for i, a in enumerate(arms):
        s = summary["serving"][a]
        note = "" if s["valid"] is None else \
            f"\n{s['vs_free']:.2f}x {s['baseline'].split('_')[0]}\nvalid {s['valid']}/{s['requests']}"
        ax.annotate(f"{tps[i]:.1f} tok/s{note}", (i, tps[i]), ha="center", textcoords="offset points",
                    xytext=(0, 3), fontsize=7)
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title("Decode speed under each constraint", fontsize=9)
    ax.tick_params(axis="x", labelsize=7, rotation=15)
    eng = summary["engines"]
    names = ["llguidance", "llama_cpp_gbnf"]
    cost = [eng[n].get("mask_ms_per_token", 0) for n in names]
    bx.bar(names, cost, color=["tab:blue", "tab:red"])
    bx.set_yscale("log")
    for i, c in enumerate(cost):
        bx.annotate(f"{c:.2f} ms/token\ncompile {eng[names[i]].get('compile_ms', 0):.1f} ms", (i, c), ha="center",
                    textcoords="offset points", xytext=(0, 3), fontsize=7)
    bx.set_ylabel("mask cost per token (ms, log)")
    bx.set_title(f"20-tool call grammar, {eng['vocab']}-token vocabulary", fontsize=9)
    fig.suptitle("Constrained decoding, Qwen2.5-Coder 1.5B target, 2 CPU cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def planner(rows: list[dict[str, Any]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    n = [r["context_n"] for r in rows]
    ax.plot(n, [r["dense"]["ttft_ms"] / 1e3 for r in rows], "o-", label="dense")
    ax.plot(n, [r["specprefill"]["ttft_ms"] / 1e3 for r in rows], "s-", label="SpecPrefill")
    for r in rows:
        mark = "right" if r["planner_right"] else "WRONG"
        ax.annotate(f"planner: {r['planner']} ({mark})", (r["context_n"], r["dense"]["ttft_ms"] / 1e3),
                    textcoords="offset points", xytext=(-40, 8), fontsize=7)
    _finish(fig, ax, out, "prompt tokens (agent-shaped: tools, a tool call, a long tool result)", "TTFT (s)",
            "Planner decisions against measured TTFT, Qwen2.5-Coder 1.5B / 0.5B, 2 CPU cores")


def agent_session(summary: dict[str, Any], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / max(1, len(summary))
    for k, (arm, s) in enumerate(summary.items()):
        turns = range(1, len(s["long_ttft_s"]) + 1)
        note = (f"{s['long_correct']}/{s['long_turns']} right, call {'valid' if s['valid_call'] else 'INVALID'}"
                if s["completed"] else "did not complete")
        ax.bar([t - 0.4 + (k + 0.5) * width for t in turns], s["long_ttft_s"], width, label=f"{arm} ({note})")
    _finish(fig, ax, out, "long tool-result turn", "TTFT at the client (s)",
            "Agent session (tools, role: tool results), Qwen2.5-Coder 1.5B / 0.5B, 2 CPU cores", legend_size=7)


def overhead(values: list[float], scaling: list[dict[str, Any]], out: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.8))
    a.hist(values, bins=30)
    a.set_xlabel("gateway overhead per request (ms)")
    a.set_ylabel("requests")
    b.plot([s["sessions"] for s in scaling], [s["requests_per_s"] for s in scaling], "o-")
    b.set_xlabel("concurrent sessions")
    b.set_ylabel("requests/s (tiny model)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def eval_accuracy(summary: list[dict[str, Any]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, marker in (("original", "s"), ("compact", "^")):
        rows = [r for r in summary if r["position_mode"] == mode]
        ax.errorbar([r["kept_fraction"] for r in rows], [r["accuracy"] for r in rows],
                    yerr=[[r["accuracy"] - r["ci95"][0] for r in rows], [r["ci95"][1] - r["accuracy"] for r in rows]],
                    fmt=marker, capsize=2, label=mode, alpha=0.8)
        for r in rows:
            ax.annotate(r["setting"], (r["kept_fraction"], r["accuracy"]), fontsize=6, xytext=(3, 2),
                        textcoords="offset points")
    dense = next((r for r in summary if r["setting"] == "dense"), None)
    if dense:
        ax.axhline(dense["accuracy"], color="k", ls="--", lw=1, label="dense")
    ax.set_xlabel("mean kept fraction")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def scorer_cost(rule: list[dict[str, Any]], out: Path) -> None:
    """Scoring cost against retention per scorer arm (evals.scorer_adoption)."""
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    for r in rule:
        lo, hi = r["retention_ci95"]
        color = "tab:green" if r["selectable"] else "tab:orange" if r.get("as_written") else \
            "k" if r["setting"].startswith("full-max-la1") else "tab:gray"
        ax.errorbar([r["cost_vs_today"]], [r["retention"]], yerr=[[r["retention"] - lo], [hi - r["retention"]]],
                    fmt="o", color=color, capsize=2, alpha=0.85)
        ax.annotate(r["setting"], (r["cost_vs_today"], r["retention"]), fontsize=6, xytext=(3, 2),
                    textcoords="offset points")
    ax.axhline(1.0, color="k", ls="--", lw=1, label="dense (retention 1)")
    ax.axvline(1.0, color="tab:blue", ls=":", lw=1, label="today's scorer (cost 1)")
    ax.axvline(0.6, color="tab:red", ls=":", lw=1, label="adoption limit (0.6)")
    ax.set_xlabel("scoring time / today's scorer's (same run)")
    ax.set_ylabel("answer retention vs dense (95% paired bootstrap)")
    ax.set_title("Cheaper scorers: green = selectable; orange = interval reaches dense, point retention < 0.9",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, out)


def scorers_ttft(summary: list[dict[str, Any]], out: Path) -> None:
    """First-turn speedup over dense per scorer arm and prompt length (bench.scorers)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    arms = list(summary[0]["speedup"]) if summary else []
    width = 0.8 / max(1, len(arms))
    for j, arm in enumerate(arms):
        xs = [i + j * width for i in range(len(summary))]
        ax.bar(xs, [s["speedup"][arm] for s in summary], width, label=arm)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(summary))],
                  [f"{s['context_n']} tokens" for s in summary])
    ax.axhline(1.0, color="k", ls="--", lw=1, label="dense")
    ax.set_ylabel("first-turn TTFT speedup over dense")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    _save(fig, out)


def specattn_ppl(texts: list[dict[str, Any]], out: Path) -> None:
    fig, axes = plt.subplots(1, len(texts), figsize=(5.5 * len(texts), 4.2), squeeze=False)
    for ax, doc in zip(axes[0], texts, strict=True):
        for name, m in doc["methods"].items():
            marker = "o" if name.startswith("specattn") else {"dense": "*", "streaming": "v", "quest": "s"}[name]
            ax.plot(100 * m["kv_reduction"], m["ppl"], marker, ms=9, label=name)
        ax.set_xlabel("KV-access reduction (%)")
        ax.set_ylabel("perplexity")
        ax.set_title(f"{doc['text']}: {doc['n_scored']} tokens scored", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, out)


def specattn_decode(contexts: list[dict[str, Any]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = [r["arm"] for r in contexts[0]["rows"]]
    width = 0.8 / len(contexts)
    for k, c in enumerate(contexts):
        xs = [i + k * width for i in range(len(names))]
        ax.bar(xs, [r["tokens_per_s"] for r in c["rows"]], width, label=f"{c['n_prompt']} tokens")
    ax.set_xticks([i + width * (len(contexts) - 1) / 2 for i in range(len(names))], names, fontsize=8)
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Decode speed, Qwen2.5-Coder 1.5B target / 0.5B draft, 2 CPU cores", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    _save(fig, out)


def soak(samples: list[dict[str, Any]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.8))
    t = [s["t_s"] for s in samples]
    ax.plot(t, [s["rss_mb"] for s in samples], label="server RSS (MB)")
    ax.plot(t, [s.get("specgate_kv_bytes_ram", 0) / 2**20 for s in samples], label="parked KV in RAM (MB)")
    ax.plot(t, [s.get("specgate_kv_bytes_disk", 0) / 2**20 for s in samples], label="spilled KV on disk (MB)")
    if any("redis_mb" in s for s in samples):  # a few MB: on an axis of its own, or it is a flat line at 0
        right = ax.twinx()
        right.plot(t, [s.get("redis_mb", 0) for s in samples], color="tab:red", label="Redis used memory (MB)")
        right.set_ylabel("Redis MB", color="tab:red")
        right.set_ylim(bottom=0)
        right.legend(fontsize=8, loc="lower right")
    _finish(fig, ax, out, "seconds", "MB", "soak: sessions x turns, tiny models, 16 MB KV budget", legend_size=8)


def concurrency(rows: list[dict[str, Any]], out: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm and "error" not in r]
        n = [r["sessions"] for r in mine]
        line, = a.plot(n, [r["decode_tok_s"] or 0 for r in mine], "o-", label=arm)
        b.plot(n, [r["ttft_p95_s"] for r in mine], "o-", color=line.get_color(), label=f"{arm} p95")
        b.plot(n, [r["ttft_p50_s"] for r in mine], "s--", color=line.get_color(), label=f"{arm} p50")
    a.set_ylabel("aggregate decode tokens/s")
    b.set_ylabel("TTFT (s): p95 solid, p50 dashed")
    for ax in (a, b):
        ax.set_xlabel("concurrent agent sessions")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Concurrent agent sessions, Qwen2.5-Coder 1.5B / 0.5B, 2 CPU cores", fontsize=9)
    _save(fig, out)


def long_prefill(rows: list[dict[str, Any]], out: Path) -> None:
    ok = [r for r in rows if "error" not in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(ok))
    for i, (key, label) in enumerate((("itl_solo", "alone"), ("itl_before", "with the other streamers"),
                                      ("itl_during_long_prefill", "during the long prefill"))):
        a.bar(x + (i - 1) * 0.27, [r[key]["p95_s"] or 0 for r in ok], 0.27, label=label)
    a.set_yscale("log")  # a stalled stream's gaps are seconds, the others' a tenth of one
    a.set_ylabel("streamers' p95 inter-token latency (s, log)")
    b.bar(x, [r["long_ttft_s"] or 0 for r in ok], 0.5, color="tab:gray")
    b.set_ylabel("long turn's TTFT (s)")
    for ax in (a, b):
        ax.set_xticks(x, [r["arm"] for r in ok], fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    a.legend(fontsize=8)
    fig.suptitle("Agents streaming while another prefills a long tool result, 1.5B / 0.5B, 2 CPU cores", fontsize=9)
    _save(fig, out)


def stateless(summary: dict[str, Any], out: Path) -> None:
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.2))
    width = 0.8 / max(len(summary), 1)
    for k, (arm, turns) in enumerate(summary.items()):
        x = np.arange(len(turns)) + k * width
        ax.bar(x, [t["ttft_s"] for t in turns], width, label=arm)
        bx.bar(x, [t["reused_tokens"] for t in turns], width, label=arm)
        for i, t in enumerate(turns):
            ax.annotate(f"{t['ttft_s']:.1f}", (x[i], t["ttft_s"]), ha="center", fontsize=7,
                        textcoords="offset points", xytext=(0, 2))
    for a, label in ((ax, "TTFT (s)"), (bx, "prompt tokens reused")):
        a.set_xticks(np.arange(len(next(iter(summary.values())))) + width * (len(summary) - 1) / 2)
        a.set_xticklabels([f"turn {t['turn']}" for t in next(iter(summary.values()))])
        a.set_ylabel(label)
        a.legend(fontsize=7)
    fig.suptitle("An agent session named vs resent whole (stateless), and llama-server", fontsize=9)
    _save(fig, out)


def agent_scale(summary: dict[str, Any], out: Path) -> None:
    """TTFT of each arm of ``bench agent_scale``, by backend, with the share of the prompt reused."""
    arms = [k for k in summary if "/" in k and "ttft_s" in summary[k]]  # not a stop's own figures
    colors = {"directory": "tab:blue", "redis": "tab:red", "unified": "tab:purple", "stopped": "tab:orange",
              "llama_server": "tab:grey"}
    fig, ax = plt.subplots(figsize=(12, 4.6))
    ttft = [summary[k]["ttft_s"] for k in arms]
    ax.bar(range(len(arms)), ttft, color=[colors.get(k.split("/")[0], "tab:green") for k in arms])
    for i, k in enumerate(arms):
        s = summary[k]
        note = f"{s['ttft_s']:.1f} s\n{100 * s['cached_share']:.1f}% reused"
        if s.get("load_s") is not None:
            note += f"\nload {s['load_s']:.1f} s"
        ax.annotate(note, (i, ttft[i]), ha="center", textcoords="offset points", xytext=(0, 3), fontsize=7)
    ax.set_xticks(range(len(arms)))
    ax.set_xticklabels([k.replace("/", "\n") for k in arms], fontsize=7)
    ax.set_yscale("log")  # minutes cold, tenths of a second for a sibling
    ax.set_ylim(min(ttft) / 2, max(ttft) * 4)
    ax.set_ylabel("TTFT (s, log scale)")
    ax.set_title("A Claude Code-sized prefix (~11.8K tokens) once computed: SpecGate's KV tier "
                 "(directory, Redis; split and unified KV) and llama-server, 2 CPU cores", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    _save(fig, out)


def depth(summary: dict[str, Any], out: Path) -> None:
    """``bench depth``: TTFT per turn, default against dense, and decode speed per mode at depth."""
    turns = summary["turns"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [3, 1]})
    x = np.arange(len(turns))
    for k, (arm, color) in enumerate((("default", "tab:blue"), ("dense", "tab:grey"))):
        ax.bar(x + 0.4 * k, [t["ttft_s"][arm] for t in turns], 0.4, label=arm, color=color)
    for i, t in enumerate(turns):
        ax.annotate(f"{t['speedup']:.2f}x\n{t['status']}", (i, t["ttft_s"]["default"]), ha="center",
                    textcoords="offset points", xytext=(0, 3), fontsize=7)
    ax.set_xticks(x + 0.2)
    ax.set_xticklabels([f"turn {t['turn']}\n{t['depth'] / 1e3:.1f}K deep" for t in turns], fontsize=8)
    ax.set_ylabel("TTFT (s)")
    ax.legend(fontsize=8)
    ax.set_title("Tool turns deep in a Claude Code-sized context", fontsize=9)
    modes = {m: v for m, v in summary["decode_tok_s_at_depth"].items()}
    bx.bar(list(modes), [v or 0 for v in modes.values()], color="tab:green")
    for i, v in enumerate(modes.values()):
        bx.annotate("n/a" if v is None else f"{v:.1f}", (i, v or 0), ha="center", textcoords="offset points",
                    xytext=(0, 3), fontsize=7)
    bx.tick_params(axis="x", labelsize=7)
    bx.set_ylabel("decode tokens/s")
    bx.set_title(f"Decoding at {summary['decode_depth'] / 1e3:.1f}K", fontsize=9)
    _save(fig, out)


def _finish(fig: Any, ax: Any, out: Path, xlabel: str, ylabel: str, title: str,
            legend_size: int | None = None) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    _save(fig, out)


def _save(fig: Any, out: Path) -> None:
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
