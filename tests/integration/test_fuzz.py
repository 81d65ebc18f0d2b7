"""A short schemathesis fuzz of the HTTP API (``/openapi.json``) against a live server on
tiny models: no generated request, valid or not, may get a 5xx.  ``specgate bench fuzz``
runs the long one."""

from __future__ import annotations

import pytest

from bench.fuzz import FUZZ_KEY, schemathesis
from tests.support import ServerProcess

pytestmark = pytest.mark.redis


def test_schemathesis_finds_no_server_error(tiny_target, tiny_speculator, redis_server):
    # generated bodies mostly set no max_tokens: a short default keeps each reply (tiny models
    # never stop on their own) from running to the 4096 default, which tests nothing more here
    srv = ServerProcess(tiny_target, tiny_speculator, "--redis-url", redis_server.url, "--min-tokens", "0",
                        "--max-queue", "256", "--default-max-tokens", "64", env={"SPECGATE_API_KEYS": FUZZ_KEY})
    try:
        report = schemathesis(srv.base, examples=15)
        log = srv.output()
    finally:
        srv.stop()
    assert report["cases"] > 100, report["output_tail"]
    assert report["server_errors"] == 0 and report["exit_code"] == 0, report["output_tail"]
    assert "unhandled_error" not in log  # (aiohttp itself logs the NUL-byte header probe it refuses with 400)
