"""Fixtures several modules share; a module imports the one it uses under the name its
tests take (`from tests.helpers.fixtures import redis_server as server`)."""
from __future__ import annotations

import pytest

from tests.redis_server import RedisServer, require_redis_server


@pytest.fixture(scope="module")
def llama_tiny_runtime(tmp_path_factory):
    """The llama-tiny runtime (seeded random weights) of the module, closed after it."""
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig

    rt = Runtime(RuntimeConfig(model="llama-tiny",
                               offload_dir=str(tmp_path_factory.mktemp("off"))))
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def redis_server():
    """A redis-server of the module's own (skipped or failed as redis_server.py says when
    there is none)."""
    with RedisServer(require_redis_server()) as srv:
        yield srv
