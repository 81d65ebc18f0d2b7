"""The keyless loopback default refuses web pages: a foreign Origin, or a Host that is not
loopback (DNS rebinding), decided by pure predicates."""

from __future__ import annotations

import pytest

from gateway import auth
from gateway.serve_config import GatewayConfig


@pytest.mark.parametrize("host, origin", [
    ("127.0.0.1:8080", None), ("localhost:8080", None), ("[::1]:8080", None), (None, None),
    ("127.0.0.1:8080", "http://localhost:3000"), ("127.0.0.1:8080", "http://127.0.0.1:8080"),
    ("127.0.0.2", "https://[::1]:5173"),
])
def test_this_machines_clients_are_local(host, origin):
    assert auth.local_request(host, origin)


@pytest.mark.parametrize("host, origin", [
    ("127.0.0.1:8080", "https://evil.example"),  # a page elsewhere POSTs text/plain without a preflight
    ("evil.example:8080", None),  # DNS rebinding: the page's own name now points at 127.0.0.1
    ("evil.example:8080", "http://evil.example:8080"),
    ("127.0.0.1:8080", "null"),  # a sandboxed frame or a file:// page
    ("192.168.1.5:8080", None),
])
def test_web_pages_are_not(host, origin):
    assert not auth.local_request(host, origin)


def test_only_the_keyless_loopback_default_guards():
    none, some = auth.ApiKeys([]), auth.ApiKeys(["k"])
    assert auth.guards_origin(GatewayConfig(), none)
    assert not auth.guards_origin(GatewayConfig(), some)  # a key no page knows protects it
    assert not auth.guards_origin(GatewayConfig(host="0.0.0.0"), none)  # a public bind chose exposure
    assert not auth.guards_origin(GatewayConfig(allow_foreign_origins=True), none)
