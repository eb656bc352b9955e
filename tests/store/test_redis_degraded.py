"""The shared Redis store degrades, never fails: Redis down at start, down under the admin API and
the page, restarted empty under running replicas, and holding keys of the wrong type.

Real ``redis-server`` processes on loopback ports (each test that kills or wipes one starts its
own), real kvwarm apps on real sockets, the reference upstream behind them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.app import STORE
from proxy.errors import StoreError
from proxy.store.base import SessionTotals, TurnWrite
from proxy.store.redis.store import RedisStore
from tests.agents import SAFE_DRIFTS, Agent, Turn
from tests.conftest import ProxyFactory, metric, need_redis, poster
from tests.store.redis_server import RedisServer

DRIFT = SAFE_DRIFTS["args_keys_reordered"]
"""A drift every turn's re-sent tool call carries: a matched turn is a repaired turn."""


# -- helpers -----------------------------------------------------------------------------------


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def own_redis(tmp_path: Path) -> Any:
    """A ``redis-server`` of this test's own (not started: the test starts, kills and restarts it)."""
    need_redis()
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


async def shared(make_proxy: ProxyFactory, sim: TestServer, url: str, prefix: str) -> TestServer:
    """A kvwarm replica on Redis with no configured secret: the secret is the one in Redis."""
    return await make_proxy(sim, store__backend=url, store__redis_prefix=prefix, store__timeout=0.5)


async def get(server: TestServer, path: str, **headers: str) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as s, s.get(server.make_url(path), headers=headers) as r:
        return r.status, r.content_type, await r.read()


async def until(predicate: Callable[[], Any], seconds: float) -> bool:
    """Wait for ``predicate`` (awaited when it returns an awaitable); False when it never held."""
    deadline = time.monotonic() + seconds
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)


async def ready(server: TestServer) -> bool:
    status, _, body = await get(server, "/readyz")
    return status == 200 and orjson.loads(body)["status"] == "ready"


def prefix_of(turn: Turn) -> tuple[int, int]:
    """(matched messages, repairs) of a turn, from its ``x-kvwarm-prefix`` header."""
    header = turn.response["_headers"].get("x-kvwarm-prefix", "")
    fields = dict(part.split("=", 1) for part in header.split("; ") if "=" in part)
    return int(fields.get("matched", "0/0").split("/")[0]), int(fields.get("repaired", "0"))


def alternating(*servers: TestServer) -> Any:
    """An agent's ``post`` that sends each request to the next replica in turn, the first first."""
    posts = [poster(s) for s in servers]
    sent = 0

    async def post(body: dict[str, Any]) -> dict[str, Any]:
        nonlocal sent
        sent += 1
        return await posts[(sent - 1) % len(posts)](body)

    return post


# -- 4. Redis down at start ---------------------------------------------------------------------


async def test_started_while_redis_is_down_it_serves_then_repairs_once_redis_answers(
    own_redis: RedisServer, make_sim: Any, make_proxy: ProxyFactory, prefix: str
) -> None:
    sim = await make_sim(cache_mode="vllm")
    proxy = await shared(make_proxy, sim, own_redis.url, prefix)  # nothing listens on its port yet
    agent = Agent(poster(proxy), drift=DRIFT)
    await agent.run(3)  # served by the upstream, unrepaired
    assert [prefix_of(t)[1] for t in agent.turns] == [0, 0, 0]
    assert metric(proxy, "kvwarm_errors_total", stage="store") >= 1
    assert not await ready(proxy)
    # A tenant cannot be named yet: its admin views say the store is unavailable.
    status, _, body = await get(proxy, "/kvwarm/sessions", Authorization="Bearer sk-alice")
    assert status == 503 and orjson.loads(body)["error"]["code"] == "store_unavailable"
    status, _, body = await get(proxy, "/kvwarm/api/overview", Authorization="Bearer sk-alice")
    assert status == 200 and orjson.loads(body)["store"]["available"] is False

    own_redis.start()
    assert await until(lambda: ready(proxy), 10), "the store did not reconnect"
    assert own_redis.cli("strlen", f"{prefix}:secret") == "32", "the secret was stored once Redis answered"
    fresh = Agent(poster(proxy), drift=DRIFT)
    await fresh.run(4)
    for turn in fresh.turns[1:]:
        assert prefix_of(turn)[0] >= turn.resent, turn.response["_headers"]
    assert any(prefix_of(t)[1] > 0 for t in fresh.turns[1:]), "repairs began"


# -- 5. the admin API and the page with Redis down ------------------------------------------------


async def test_admin_api_and_page_answer_with_redis_down(
    own_redis: RedisServer, make_sim: Any, make_proxy: ProxyFactory, prefix: str
) -> None:
    own_redis.start()
    sim = await make_sim(cache_mode="vllm")
    proxy = await shared(make_proxy, sim, own_redis.url, prefix)
    await Agent(poster(proxy), drift=DRIFT).run(2)
    status, _, body = await get(proxy, "/kvwarm/sessions")
    assert status == 200
    (session,) = orjson.loads(body)["data"]

    own_redis.kill()
    status, kind, body = await get(proxy, "/kvwarm/api/overview")
    assert (status, kind) == (200, "application/json")
    overview = orjson.loads(body)
    assert overview["store"]["available"] is False
    assert "The session store is unavailable" in overview["store"]["message"]
    assert overview["sessions"] == [] and overview["session_count"] is None
    assert overview["totals"]["requests"] == 2, "the process's own figures are still there"
    assert overview["totals"]["prompt_tokens"] > 0

    status, kind, body = await get(proxy, "/kvwarm/")
    assert (status, kind) == (200, "text/html")
    page = body.decode()
    assert "The session store is unavailable" in page and "the store is unavailable" in page
    assert '<p class="big" data-k="requests">2</p>' in page

    for path in ("/kvwarm/sessions", f"/kvwarm/sessions/{session['id']}", f"/kvwarm/sessions/{session['id']}.md"):
        status, kind, body = await get(proxy, path)
        assert (status, kind) == (503, "application/json"), path
        error = orjson.loads(body)["error"]
        assert error["code"] == "store_unavailable" and error["type"] == "server_error"
        assert "unavailable" in error["message"]

    # A tenant reads that the store is unavailable, not why (the store's address is the operator's).
    status, _, body = await get(proxy, "/kvwarm/api/overview", Authorization="Bearer sk-alice")
    tenant = orjson.loads(body)
    assert status == 200 and tenant["scope"] == "tenant" and tenant["mine"] is None
    assert tenant["store"]["available"] is False and "redis" not in tenant["store"]["message"]
    assert await poster(proxy)({"model": "m", "messages": [{"role": "user", "content": "still served"}]})

    own_redis.start()  # empty: the store answers again, with no sessions
    assert await until(lambda: ready(proxy), 10)
    status, _, body = await get(proxy, "/kvwarm/api/overview")
    assert orjson.loads(body)["store"] == {"available": True, "health": "ok", "message": None}


# -- 6. one secret across replicas when Redis restarts empty --------------------------------------


async def test_replicas_keep_one_secret_when_redis_restarts_empty(
    own_redis: RedisServer, make_sim: Any, make_proxy: ProxyFactory, prefix: str
) -> None:
    own_redis.start()
    sim = await make_sim(cache_mode="vllm")
    old = await shared(make_proxy, sim, own_redis.url, prefix)
    secret = old.app[STORE].secret()

    own_redis.kill()
    own_redis.start()  # empty (no persistence): the secret is gone
    # The running replica notices within a second and stores its secret again...
    await until(lambda: own_redis.cli("exists", f"{prefix}:secret") == "1", 5)
    new = await shared(make_proxy, sim, own_redis.url, prefix)
    # ...so a replica started now adopts it instead of storing one of its own.
    assert new.app[STORE].secret() == old.app[STORE].secret() == secret

    agent = Agent(alternating(old, new), drift=DRIFT)
    await agent.run(4)
    for turn in agent.turns[1:]:  # each turn on the other replica than the one before
        assert prefix_of(turn)[0] >= turn.resent, turn.response["_headers"]
    assert all(prefix_of(t)[1] > 0 for t in agent.turns[1:])


async def test_a_replica_follows_the_secret_a_newcomer_stored_and_says_so_once(
    own_redis: RedisServer, tenant: bytes, make_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """When a newcomer stored its secret first, the running process follows it (the secret every
    later process adopts): the turn keyed under the old one is not written, and the next ones
    are keyed alike on both."""
    own_redis.start()
    old = RedisStore(own_redis.url, ttl_seconds=60, timeout=1.0, secret_interval=3600)
    new = RedisStore(own_redis.url, ttl_seconds=60, timeout=1.0)
    await old.open()
    try:
        before = old.secret()
        path = make_path(tenant, ["hello", ("assistant", "hi")])
        await old.write_turn(TurnWrite(nodes=path, path=(), leaf=path[-1].key, totals=SessionTotals(turns=1), now=1.0))
        own_redis.cli("flushall")  # Redis lost everything; no connection noticed it
        await new.open()  # the newcomer stores a secret of its own
        assert new.secret() != before
        more = make_path(tenant, ["hello", ("assistant", "hi"), "again"])
        turn = TurnWrite(nodes=more[-1:], path=[n.key for n in path], leaf=more[-1].key, totals=SessionTotals(turns=1), now=2.0)
        with caplog.at_level(logging.WARNING, logger="proxy.store.redis.secret"):
            with pytest.raises(StoreError, match="secret changed"):
                await old.write_turn(turn)  # finds its path gone: Redis lost data; the secret is checked
            assert old.secret() == new.secret()
            await old.write_turn(turn)  # its path still gone (it is healed now), the secret agreed
        warnings = [r for r in caplog.records if "differs from this process's" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    finally:
        await old.close()
        await new.close()


# -- 7. keys of the wrong type --------------------------------------------------------------------


def _sessions_index_is_a_string(server: RedisServer, prefix: str, session: dict[str, Any]) -> None:
    key = f"{prefix}:{{{session['tenant']}}}:s"
    server.cli("del", key)
    server.cli("set", key, "not a sorted set")


def _totals_are_a_list(server: RedisServer, prefix: str, session: dict[str, Any]) -> None:
    key = f"{prefix}:{{{session['tenant']}}}:t:{session['id']}"
    server.cli("del", key)
    server.cli("rpush", key, "not", "a", "hash")


def _tenants_hold_garbage(server: RedisServer, prefix: str, session: dict[str, Any]) -> None:
    server.cli("del", f"{prefix}:tenants")
    server.cli("set", f"{prefix}:tenants", "garbage")


def _tenants_list_garbage(server: RedisServer, prefix: str, session: dict[str, Any]) -> None:
    server.cli("zadd", f"{prefix}:tenants", "1", "not-hex", "2", "abcd")


@pytest.mark.parametrize(
    ("damage", "turns_after"),
    [
        (_sessions_index_is_a_string, 3),  # the next write replaces the index
        (_totals_are_a_list, 1),  # the damaged totals are dropped: the session counts from here
        (_tenants_hold_garbage, 3),  # the next announce replaces the list
        (_tenants_list_garbage, 3),
    ],
)
async def test_keys_of_the_wrong_type_are_counted_misses(
    redis: RedisServer, make_sim: Any, make_proxy: ProxyFactory, prefix: str, damage: Any, turns_after: int
) -> None:
    sim = await make_sim(cache_mode="vllm")
    proxy = await shared(make_proxy, sim, redis.url, prefix)
    agent = Agent(poster(proxy), drift=DRIFT)
    await agent.run(2)
    status, _, body = await get(proxy, "/kvwarm/sessions")
    (session,) = orjson.loads(body)["data"]
    corrupt = metric(proxy, "kvwarm_store_corrupt_entries")

    damage(redis, prefix, session)
    for path in ("/kvwarm/sessions", "/kvwarm/", "/kvwarm/api/overview", f"/kvwarm/sessions/{session['id']}"):
        status, _, body = await get(proxy, path)
        assert status in (200, 404), (path, body[:300])  # the session itself: absent when its totals are damaged
    status, _, body = await get(proxy, "/kvwarm/api/overview")
    assert status == 200 and orjson.loads(body)["store"]["available"] is True
    assert metric(proxy, "kvwarm_store_corrupt_entries") > corrupt, "the damaged key is a counted miss"

    # Requests pass, and a write replaces the damaged key it needs. P:tenants is announced by
    # each process once a minute per tenant: the next turn goes through a replica that has not yet.
    if damage is _tenants_hold_garbage:
        agent.post = poster(await shared(make_proxy, sim, redis.url, prefix))
    turn = await agent.step()
    assert prefix_of(turn)[0] >= turn.resent > 0
    status, _, body = await get(proxy, "/kvwarm/sessions")
    assert status == 200 and [s["turns"] for s in orjson.loads(body)["data"]] == [turns_after]
