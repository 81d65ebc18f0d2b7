"""API keys: who is calling, and so which sessions they may see.

Keys come from ``api_keys`` (``SPECGATE_API_KEYS=k1,k2``) and ``api_keys_file``
(one per line).  Only their SHA-256 digests are kept.  A client sends
``Authorization: Bearer <key>`` (what the ``openai`` client sends) or
``x-api-key: <key>`` (what the ``anthropic`` client sends) on HTTP and on the
WebSocket upgrade.  Each key has an owner id -- a prefix of its digest --
that namespaces every session it creates; with no keys configured every
client is the one owner ``anonymous``.  ``/health``, ``/ready`` and
``/metrics`` stay open so balancers and scrapers need no key.  With no keys on the
loopback default, a request whose ``Origin`` or ``Host`` names another machine is refused
(:func:`local_request`): a web page must not drive the server a developer runs locally.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from pathlib import Path

import structlog
from aiohttp import web

from core.errors import ConfigError, ForeignOrigin, Unauthorized
from gateway.serve_config import GatewayConfig

log = structlog.get_logger("specgate.auth")
ANONYMOUS = "anonymous"
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json"})


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        self._digests = {_digest(k) for k in keys if k}

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> ApiKeys:
        keys = list(cfg.api_keys)
        if cfg.api_keys_file:
            try:
                lines = Path(cfg.api_keys_file).read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"api_keys_file: cannot read {cfg.api_keys_file}: {exc}") from exc
            keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def owner(self, authorization: str | None, api_key: str | None = None) -> str:
        """The caller's owner id from ``Authorization: Bearer`` or ``x-api-key``;
        :class:`Unauthorized` for a missing or unknown key."""
        if not self.enabled:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        if not authorization and api_key:
            scheme, token = "bearer", api_key
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        digest = _digest(token.strip())
        # compare against every digest so timing says nothing about which prefix matched
        if not any(hmac.compare_digest(digest, d) for d in self._digests):
            raise Unauthorized("invalid API key")
        return "k" + digest[:16]


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address, no port) is this machine's loopback."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() in ("localhost", "localhost.")


def host_of(value: str) -> str:
    """The host part of a ``Host`` header or an ``Origin`` URL (without scheme and port)."""
    rest = value.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):  # [::1]:8080
        return rest[: rest.find("]") + 1]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def local_request(host: str | None, origin: str | None) -> bool:
    """Whether a request to a keyless loopback server comes from this machine's own clients:
    its ``Host`` (if any) names loopback, and so does its ``Origin`` (if any; browsers send
    one with every cross-origin POST).  A web page elsewhere, or one that rebinds its own
    name to 127.0.0.1, fails one of the two."""
    if host and not is_loopback(host_of(host)):
        return False
    return origin is None or (origin != "null" and is_loopback(host_of(origin)))


def warn_if_exposed(cfg: GatewayConfig, keys: ApiKeys) -> None:
    loopback = is_loopback(cfg.host)
    if not loopback and not keys.enabled:
        log.warning("no_authentication", host=cfg.host,
                    message="serving on a non-loopback address with no API keys: anyone who can reach "
                            "this port can read, continue and delete every session; set SPECGATE_API_KEYS")


OWNER = web.RequestKey("owner", str)


def guards_origin(cfg: GatewayConfig, keys: ApiKeys) -> bool:
    """The keyless loopback default refuses web pages (``allow_foreign_origins`` lifts it):
    a key a page cannot know protects a server with keys; a public bind chose exposure."""
    return not keys.enabled and is_loopback(cfg.host) and not cfg.allow_foreign_origins


def check_local(request: web.Request) -> None:
    if not local_request(request.headers.get("Host"), request.headers.get("Origin")):
        raise ForeignOrigin("this keyless server on loopback takes requests from this machine's clients only "
                            f"(Origin {request.headers.get('Origin')!r}, Host {request.headers.get('Host')!r}); "
                            "set API keys, or --allow-foreign-origins")
