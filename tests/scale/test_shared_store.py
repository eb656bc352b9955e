"""Two kvwarm instances on one Redis behave as one: an agent whose every request goes to the
other instance gets the same rescue as through a single instance, Redis failures never fail
a request, and repairs resume on their own when Redis is back.

Real ``redis-server`` processes on free loopback ports (standalone and a 3-master cluster),
real kvwarm apps on real sockets, the reference upstream behind them.
"""

from __future__ import annotations

import asyncio
import uuid
from itertools import cycle
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.sim.render import render_tokens
from tests.agents import SAFE_DRIFTS, Agent
from tests.conftest import ProxyFactory, metric, poster, received
from tests.store.redis_server import RedisClusterProcesses, RedisServer, binaries_missing

TURNS = 6


def alternating(*servers: TestServer) -> Any:
    """An agent's ``post`` that sends each request to the next instance in turn (a round-robin balancer)."""
    posts = cycle([poster(s) for s in servers])

    async def post(body: dict[str, Any]) -> dict[str, Any]:
        return await next(posts)(body)

    return post


def rendered(sim: TestServer) -> list[list[int]]:
    out = []
    for req in received(sim):
        body = orjson.loads(req.body)
        out.append(render_tokens(body["messages"], body.get("tools")))
    return out


async def replicas(make_proxy: ProxyFactory, sim: TestServer, url: str, n: int = 2) -> list[TestServer]:
    prefix = f"t{uuid.uuid4().hex[:10]}"  # each test its own keys on the shared server
    return [
        await make_proxy(sim, store__backend=url, store__redis_prefix=prefix, store__secret="shared-secret", store__timeout=2.0)
        for _ in range(n)
    ]


@pytest.mark.parametrize("mode", ["openai", "vllm"])
@pytest.mark.parametrize("drift_name", sorted(SAFE_DRIFTS))
async def test_two_instances_on_one_redis_rescue_like_one(
    redis: RedisServer, make_sim: Any, make_proxy: ProxyFactory, mode: str, drift_name: str
) -> None:
    drift = SAFE_DRIFTS[drift_name]
    clean_sim, one_sim, two_sim = [await make_sim(cache_mode=mode) for _ in range(3)]
    single = await make_proxy(one_sim)  # one instance, memory store: the reference
    pair = await replicas(make_proxy, two_sim, redis.url)

    clean = await Agent(poster(clean_sim)).run(TURNS)
    one = await Agent(poster(single), drift=drift).run(TURNS)
    two = await Agent(alternating(*pair), drift=drift).run(TURNS)

    # Through two instances the upstream saw exactly what one instance (and a clean client) sent.
    assert rendered(two_sim) == rendered(one_sim) == rendered(clean_sim)
    assert [t.cached for t in two] == [t.cached for t in one] == [t.cached for t in clean]
    # Each instance served half the turns and recognised the other's.
    for t in two[1:]:
        assert t.response["_headers"]["x-kvwarm-prefix"].startswith(f"matched={t.resent}/")


async def test_redis_killed_mid_session_fails_no_request_and_repairs_resume(
    tmp_path: Any, make_sim: Any, make_proxy: ProxyFactory
) -> None:
    why = binaries_missing()
    if why is not None:
        pytest.skip(why)
    server = RedisServer(tmp_path / "redis").start()
    try:
        sim = await make_sim(cache_mode="vllm")
        pair = await replicas(make_proxy, sim, server.url)
        agent = Agent(alternating(*pair), drift=SAFE_DRIFTS["args_keys_reordered"])
        await agent.run(3)
        assert "repaired=" in agent.turns[-1].response["_headers"]["x-kvwarm-prefix"]

        server.kill()
        for _ in range(3):  # every request still succeeds (forwarded unrepaired)
            turn = await agent.step()
            assert turn.response["choices"][0]["message"]
        errors = sum(metric(p, "kvwarm_errors_total", stage="store") for p in pair)
        assert errors >= 3
        for p in pair:
            async with aiohttp.ClientSession() as s:
                async with s.get(p.make_url("/readyz")) as r:
                    ready = await r.json()
                async with s.get(p.make_url("/healthz")) as r:
                    assert r.status == 200
            assert ready["status"] == "degraded" and ready["store"].startswith("degraded")

        server.start()  # same port, empty (no persistence): sessions start over, repairs resume
        fresh = Agent(alternating(*pair), drift=SAFE_DRIFTS["args_keys_reordered"])
        for p in pair:  # each instance's store reconnects on its own, with backoff
            for _ in range(50):
                async with aiohttp.ClientSession() as s, s.get(p.make_url("/readyz")) as r:
                    if (await r.json())["status"] == "ready":
                        break
                await asyncio.sleep(0.1)
        await fresh.run(4)
        headers = [t.response["_headers"]["x-kvwarm-prefix"] for t in fresh.turns]
        assert any("repaired=0" not in h for h in headers[1:]), headers
        for t in fresh.turns[1:]:
            # At least what it re-sent: the same conversation was stored before the restart too
            # (the processes' caches of immutable nodes heal it back into Redis).
            matched = int(t.response["_headers"]["x-kvwarm-prefix"].split("matched=")[1].split("/")[0])
            assert matched >= t.resent
    finally:
        server.stop()


@pytest.mark.parametrize("drift_name", ["tools_reordered", "args_keys_reordered", "tool_results_reordered"])
async def test_two_instances_on_a_redis_cluster_rescue_like_one(
    cluster: RedisClusterProcesses, make_sim: Any, make_proxy: ProxyFactory, drift_name: str
) -> None:
    drift = SAFE_DRIFTS[drift_name]
    one_sim, two_sim = [await make_sim(cache_mode="vllm") for _ in range(2)]
    single = await make_proxy(one_sim)
    pair = await replicas(make_proxy, two_sim, cluster.url)
    one = await Agent(poster(single), drift=drift).run(TURNS)
    two = await Agent(alternating(*pair), drift=drift).run(TURNS)
    assert rendered(two_sim) == rendered(one_sim)
    assert [t.cached for t in two] == [t.cached for t in one]
