"""Fixtures: real models (fetched by the README's test command), tiny models derived
from the real speculator, a real redis-server and a real gateway.  Helpers live in
tests/support.py.  Engine imports stay inside fixtures, so the unit tests run
without llama-cpp-python installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.models import model_files
from tests.support import RedisServer, engine_config, real_model, start_gateway, tiny


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration/" in item.nodeid:
            item.add_marker(pytest.mark.models)
        if "redis_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis)


@pytest.fixture(scope="session")
def tiny_speculator() -> Path:
    return tiny(2)


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    return tiny(3)


@pytest.fixture(scope="session")
def small_model() -> Path:
    return real_model(model_files.SMALL)


def _engine(target: Path, speculator: Path, **fields):
    from core.engine import Engine

    return Engine(engine_config(target, speculator, **fields))


@pytest.fixture(scope="session")
def tiny_engine(tiny_speculator: Path, tiny_target: Path):
    engine = _engine(tiny_target, tiny_speculator)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def smol_engine(small_model: Path):
    """A real, coherent small model as both speculator and target: greedy outputs
    without the near-ties of the truncated models (for exact-equality tests)."""
    engine = _engine(small_model, small_model)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def smol_pair_engine(small_model: Path):
    """Full SmolLM2 as target, its first 20 blocks as draft: a draft that agrees often
    but not always, so speculative rounds both accept and reject."""
    engine = _engine(small_model, tiny(20, model_files.SMALL), kv_layout="unified")  # SpecAttn's views
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(tiny_target: Path, tiny_speculator: Path, redis_server):
    server = start_gateway(tiny_target, tiny_speculator, redis_url=redis_server.url, max_queue=4)
    yield server
    server.stop()
