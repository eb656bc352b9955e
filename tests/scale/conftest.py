"""Real Redis servers for the scale-out tests: one standalone server and one 3-master cluster per
test module, on free loopback ports; skipped, with the reason, where ``redis-server`` is absent."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.store.redis_server import RedisClusterProcesses, RedisServer, binaries_missing


def need_redis() -> None:
    why = binaries_missing()
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    need_redis()
    procs = RedisClusterProcesses(tmp_path_factory.mktemp("cluster")).start()
    yield procs
    procs.stop()
