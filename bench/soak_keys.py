"""``specgate bench soak --two-keys``: two API keys' agents side by side for many minutes, with
every path that moves KV between slots busy, and a check that no key's cells ever reach the
other key's sessions (issue 51).

The real app (``gateway.app.create_app``) serves on a loopback port in this process, with a
real redis-server and a KV tier folder, three slots for six agents (so sessions are parked,
restored and displaced all the time), sibling adoption and splices on, checkpoints written and
lent, and a 20 s session TTL.  Each key's agents run conversations for ``minutes``: named
sessions and implicit ones (the history resent with no id), on the key's shared system prompt
or a private one, each user turn repeating an environment note (what splices move); a
conversation ends deleted, abandoned to expire, or left idle.

Every text a key sends carries its canary words, which the other key never sends.  Once a
second, on the model thread, every slot's cells in both models are read and each cell's
layer-0 V row -- which depends on its token alone -- is compared with the other key's canary
tokens' rows: a cell of one key's canary in the other key's slot is a cross-key cell.  Every
reply is also checked for the other key's canary words."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.common import free_port, progress, write_result
from bench.serving import redis_server, rss_mb

KEYS = {"key-a": "Orchid flamingo quartz saffron.", "key-b": "Walrus tangerine obsidian zephyr."}
WORDS = ("valve pump sensor log line reading pressure flow alarm reset shift operator panel unit check "
         "cycle status north south east west level drift").split()
NOTE = ("Environment: working directory /srv/plant, a git repository on branch main; platform linux; "
        "the historian answers on port 8086; logs rotate daily at midnight UTC. ") * 6
TTL_S = 20
OWNERS = {"k" + hashlib.sha256(k.encode()).hexdigest()[:16]: k for k in KEYS}  # gateway.auth's owner ids


def system_prompt(key: str, private: str | None) -> str:
    head = f"Conversation {private}. " if private else ""
    return head + f"You keep plant logs. Project words: {KEYS[key]} " + "Units report every minute. " * 30


class Tally:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self.leaks: list[str] = []

    def error(self, what: str) -> None:
        self.errors.append(what)
        progress(f"soak --two-keys: error {what[:200]}")


async def agent(http: httpx.AsyncClient, key: str, name: str, until: float, tally: Tally) -> None:
    rng = random.Random(name)
    other = next(v for k, v in KEYS.items() if k != key).split()
    auth = {"Authorization": f"Bearer {key}"}
    n = 0
    while time.monotonic() < until:
        n += 1
        named = rng.random() < 0.5
        sid = f"{name}-{n}" if named else None
        private = f"{name}-{n}" if rng.random() < 0.4 else None
        history: list[dict[str, Any]] = [{"role": "system", "content": system_prompt(key, private)}]
        for turn in range(rng.randint(2, 6)):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60)))
            history.append({"role": "user", "content": f"{KEYS[key]} Task {turn}: {words}\n{NOTE}"})
            headers = {**auth, **({"X-SpecGate-Session": sid} if sid else {})}
            r = await http.post("/v1/chat/completions", headers=headers,
                                json={"messages": history, "max_tokens": 8})
            tally.counts["turns"] += 1
            if r.status_code != 200:
                tally.error(f"{name} {sid or 'implicit'} turn {turn}: {r.status_code} {r.text[:300]}")
                break
            reply = r.json()["choices"][0]["message"]["content"] or ""
            if any(w.strip(".") in reply for w in other):
                tally.leaks.append(f"{name}: the other key's canary in a reply: {reply[:200]}")
            history.append({"role": "assistant", "content": reply})
            await asyncio.sleep(rng.uniform(0, 0.5))
        end = rng.random()
        if named and end < 0.3:
            r = await http.delete(f"/v1/sessions/{sid}", headers=auth)
            tally.counts["deletes"] += 1
            if r.status_code not in (200, 204):
                tally.error(f"{name} delete {sid}: {r.status_code} {r.text[:200]}")
        elif end < 0.45:
            tally.counts["pauses_past_ttl"] += 1
            await asyncio.sleep(TTL_S * 1.5)  # its sessions expire meanwhile


def canary_rows(engine: Any) -> dict[str, dict[str, np.ndarray]]:
    """Model thread: each model's layer-0 V rows of each key's canary tokens that the other
    key's texts never hold, computed in a context of their own."""
    from core.llama.context import Context

    out: dict[str, dict[str, np.ndarray]] = {}
    for role, ctx in (("target", engine.target_ctx), ("scorer", engine.speculator_ctx)):
        tokens = {k: set(ctx.model.tokenize(" " + v, add_special=False)) for k, v in KEYS.items()}
        texts = {k: set(ctx.model.tokenize(system_prompt(k, "x-1") + " Task 0: " + " ".join(WORDS) + NOTE,
                                           add_special=False)) for k in KEYS}
        own = Context(ctx.model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=engine.config.n_threads,
                      flash_attn=ctx.flash_attn)
        try:
            out[role] = {}
            for key, toks in tokens.items():
                exclusive = sorted(toks - set().union(*(t for k, t in texts.items() if k != key)))
                if not exclusive:
                    raise RuntimeError(f"{key}'s canary shares every token with the other key's texts")
                own.seq(0).clear_cells()
                own.seq(0).decode(exclusive, 0, logits_last=False)
                out[role][key] = layer0_v(own.seq(0).save(), 0)
        finally:
            own.close()
    return out


def layer0_v(blob: bytes, seq_id: int) -> np.ndarray:
    from core.llama import seq_cells

    cells = seq_cells.parse(blob, seq_id)
    v = cells.v[0]
    rows = v.transpose(1, 0, 2).reshape(len(cells), -1) if cells.v_trans else v
    return np.ascontiguousarray(rows).view("<f2" if cells.v_types[0] == seq_cells.F16 else "<f4").astype(np.float32)


def cross_key_cells(engine: Any, residency: Any, refs: dict[str, dict[str, np.ndarray]]) -> tuple[int, int]:
    """Model thread: (cells of the other key's canary found in any slot, slots looked at)."""
    found = looked = 0
    for slot in range(len(residency.slots)):
        owner = OWNERS.get(getattr(residency.slots.stamp(slot)[0], "owner", ""))
        if owner is None:
            continue
        for role, ctx in (("target", engine.target_ctx), ("scorer", engine.speculator_ctx)):
            if ctx.seq(slot).pos_max() < 0:  # empty: a saved state holds no layers to parse
                continue
            rows = layer0_v(ctx.seq(slot).save(), slot)
            looked += 1
            for key, ref in refs[role].items():
                if key != owner and len(rows):
                    dist = np.linalg.norm(rows[:, None, :] - ref[None, :, :], axis=2)
                    scale = np.linalg.norm(ref, axis=1)[None, :]
                    found += int((dist < 1e-2 * scale).any(axis=1).sum())
    return found, looked


async def checker(manager: Any, refs: Any, stop: asyncio.Event, tally: Tally) -> None:
    while not stop.is_set():
        found, looked = await manager.worker.inspect(lambda e: cross_key_cells(e, manager.residency, refs))
        tally.counts["cell_checks"] += 1
        tally.counts["slot_reads"] += looked
        if found:
            tally.leaks.append(f"{found} cells of the other key's canary at check {tally.counts['cell_checks']}")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def soak(port: int, redis_url: str, tier: str, minutes: float, layout: str, target: str, speculator: str,
               tally: Tally, samples: list[dict[str, Any]]) -> dict[str, float]:
    import os

    from aiohttp import web

    from core.config import EngineConfig
    from core.policies import PrefillPolicy
    from gateway import keys
    from gateway.app import app_runner, create_app
    from gateway.serve_config import GatewayConfig, ServeConfig

    gw = GatewayConfig(port=port, redis_url=redis_url, api_keys=tuple(KEYS), kv_tier_dir=tier, session_ttl_s=TTL_S,
                       kv_checkpoint_tokens=256, prefix_min_tokens=128, splice_min_tokens=64, kv_budget_mb=8,
                       max_queue=64, log_level="warning")
    engine = EngineConfig(target=target, speculator=speculator, n_ctx=4096, slots=3, kv_layout=layout,
                          scorer="speculator-full", calibrate_tokens=64)
    app = create_app(ServeConfig(gw, engine, PrefillPolicy(min_tokens=0, break_even=False)))
    runner = app_runner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    manager = app[keys.MANAGER]
    try:
        refs = await manager.worker.inspect(canary_rows)
        stop = asyncio.Event()
        check = asyncio.create_task(checker(manager, refs, stop, tally))
        until = time.monotonic() + minutes * 60
        t0 = time.monotonic()

        async def sample() -> None:
            while not stop.is_set():
                figures = manager.figures()
                samples.append({"t_s": round(time.monotonic() - t0, 1), "rss_mb": round(rss_mb(os.getpid()), 1),
                                **{k: figures[k] for k in ("sessions", "slots_resident", "spliced",
                                                           "prefix_adopted", "checkpoints_lent", "kv_evictions")}})
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 10.0)

        sampler = asyncio.create_task(sample())
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
            await asyncio.gather(*(agent(http, key, f"{key}-agent{i}", until, tally)
                                   for key in KEYS for i in range(3)))
        stop.set()
        await asyncio.gather(check, sampler)
        figures = manager.figures()
        figures["splices_skipped"] = getattr(manager.residency, "splices_skipped", 0)
        return figures
    finally:
        await runner.cleanup()


def run(target: str, speculator: str, out: Path, minutes: float, layout: str) -> dict[str, Any]:
    tally, samples = Tally(), []  # type: ignore[var-annotated]
    progress(f"soak --two-keys: {minutes:g} min, 6 agents of 2 keys, 3 slots, {layout} KV")
    t0 = time.perf_counter()
    with redis_server() as rport, tempfile.TemporaryDirectory(prefix="specgate-soak-tier-") as tier:
        figures = asyncio.run(soak(free_port(), f"redis://127.0.0.1:{rport}/0", tier, minutes, layout, target,
                                   speculator, tally, samples))
    summary = {"minutes": minutes, "kv_layout": layout, "wall_s": round(time.perf_counter() - t0, 1),
               **dict(tally.counts), "errors": len(tally.errors), "cross_key": len(tally.leaks),
               "spliced_tokens": figures["spliced"], "splices_skipped": figures["splices_skipped"],
               "prefix_adopted": figures["prefix_adopted"], "checkpoints_written": figures["checkpoints_written"],
               "checkpoints_lent": figures["checkpoints_lent"], "kv_evictions": figures["kv_evictions"],
               "tier_rejected": figures["tier_rejected"], "rss_mb_max": max((s["rss_mb"] for s in samples), default=0)}
    write_result(out, "soak_two_keys", {"summary": summary, "errors": tally.errors[:50], "leaks": tally.leaks[:50],
                                        "samples": samples}, {"target": target, "speculator": speculator})
    return summary
