"""The gateway's configuration (HTTP server, sessions, the store) and ``specgate
serve``'s, which adds the engine and the default turn policies."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.config import EngineConfig, Limits
from core.loader import one_of as _one_of
from core.loader import require as _require
from core.policies import DecodeMode, DecodingPolicy, PrefillPolicy


@dataclass(slots=True, frozen=True)
class GatewayConfig:
    """The HTTP server, sessions and the metadata store."""

    host: str = "127.0.0.1"
    port: int = 8080
    model_name: str = "specgate"
    redis_url: str = ""  # empty = the in-process store
    session_ttl_s: int = 86400
    auto_create_sessions: bool = True  # an unknown X-SpecGate-Session on a chat request creates the session
    kv_budget_mb: int = 2048
    prefix_min_tokens: int = 256  # a system prompt this long is cached for new sessions (0 = no prefix cache)
    splice_min_tokens: int = 256  # a run this long a sibling holds past the shared prefix is moved in (0: off)
    implicit_sessions: bool = True  # a request naming no session continues the held conversation its tokens match
    implicit_min_share: float = 0.5  # ... when the match covers at least this share of its prompt
    kv_spill_dir: str = ""
    max_queue: int = 64
    max_body_mb: int = 16
    log_level: str = "info"
    api_keys: tuple[str, ...] = ()  # SPECGATE_API_KEYS=k1,k2; none (and no file) = no authentication
    api_keys_file: str = ""  # one key per line, '#' comments
    kv_spill_max_mb: int = 8192  # disk the spilled KV may take; past it the oldest spills are dropped
    kv_tier_dir: str = "auto"  # KV that outlives the process: a folder or redis:// URL; auto = the cache dir, "" = off
    kv_tier_max_mb: int = 16384  # disk the KV tier may take; past it the least recently used entries go
    kv_checkpoint_tokens: int = 1024  # idle sessions' KV saved to the tier once grown this much (0: off)
    kv_tier_secret: str = ""  # keys the tier's checksums; empty = a secret generated into the cache dir once
    kv_tier_timeout_s: float = 5.0  # the model thread waits this long for one tier lookup, then builds instead
    kv_tier_queue_mb: int = 2048  # tier writes waiting at most; past it a checkpoint is skipped (counted)
    isolate_conversations: bool = False  # one key, many end users: share only the system prompt and tools
    # idle time catches scorers up, and rewrites held tool-call replies, in prefills this size at most (0: off);
    # a turn waits for one at most
    catch_up_tokens: int = 256
    drain_timeout_s: float = 30.0  # SIGTERM: how long running turns may take to finish
    replica_id: str = ""  # this replica's name in the session registry; empty = hostname-port
    advertise_url: str = ""  # where other replicas reach this one; empty = http://host:port
    lease_ms: int = 15000  # a session lease's TTL in Redis, renewed while the replica keeps the session
    keepalive_s: float = 10.0  # a stream sends a keepalive (Anthropic ping, SSE comment) when this long quiet
    stream_hold_s: float = 50.0  # a stream's headers wait this long for its first token: a balancer can still replay it
    allow_foreign_origins: bool = False  # keyless on loopback: also take requests from web pages (gateway/auth.py)
    keep_billing_header: bool = False  # keep Claude Code's per-conversation billing line (gateway/client_hints.py)
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        _require(self.session_ttl_s >= 1, "session_ttl_s must be >= 1")
        _require(self.kv_budget_mb >= 0, "kv_budget_mb must be >= 0")
        _require(self.prefix_min_tokens >= 0, "prefix_min_tokens must be >= 0")
        _require(self.splice_min_tokens == 0 or self.splice_min_tokens >= 16, "splice_min_tokens must be 0 or >= 16")
        _require(0.0 < self.implicit_min_share <= 1.0, "implicit_min_share must be in (0, 1]")
        _require(self.max_queue >= 1, "max_queue must be >= 1")
        _require(self.max_body_mb >= 1, "max_body_mb must be >= 1")
        _one_of("log_level", self.log_level, ("debug", "info", "warning", "error"))
        _require(self.kv_spill_max_mb >= 0, "kv_spill_max_mb must be >= 0")
        _require(self.kv_tier_max_mb >= 0, "kv_tier_max_mb must be >= 0")
        _require(self.catch_up_tokens >= 0, "catch_up_tokens must be >= 0")
        _require(self.kv_checkpoint_tokens >= 0, "kv_checkpoint_tokens must be >= 0")
        _require(self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0")
        _require(self.kv_tier_timeout_s > 0, "kv_tier_timeout_s must be > 0")
        _require(self.kv_tier_queue_mb >= 1, "kv_tier_queue_mb must be >= 1")
        _require(self.lease_ms >= 1000, "lease_ms must be >= 1000")
        _require(self.keepalive_s > 0, "keepalive_s must be > 0")
        _require(self.stream_hold_s >= 0, "stream_hold_s must be >= 0")


@dataclass(slots=True, frozen=True)
class ServeConfig:
    """``specgate serve``: the gateway, the engine, and the default turn policies."""

    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    prefill: PrefillPolicy = field(default_factory=PrefillPolicy)
    decoding: DecodingPolicy = field(default_factory=DecodingPolicy)

    def __post_init__(self) -> None:
        _require(self.decoding.mode is DecodeMode.PLAIN or self.engine.scorer_drafts,
                 f"speculative decoding drafts with the whole speculator, but --scorer is {self.engine.scorer}")
