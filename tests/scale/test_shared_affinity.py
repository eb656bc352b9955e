"""Several kvwarm instances on one Redis route a session the same way: its turns land on one
replica of the upstream pool whichever instance the load balancer picks, drifting agents
included; with Redis gone, routing falls back to rendezvous placement and no request fails.

Real ``redis-server`` processes on free loopback ports, two kvwarm apps on real sockets (each
configured with the pool in another order), a pool of reference upstreams behind them; where
each request went is read from the upstreams' own logs.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from proxy.store.redis.affinity import PREFETCH_SECONDS, RedisAffinity
from tests.agents import SAFE_DRIFTS, Post, no_drift
from tests.conftest import ProxyFactory, metric, poster, sim_url
from tests.routing.conftest import router_of, served, session_agent
from tests.store.redis_server import RedisClusterProcesses, RedisServer, binaries_missing

DRIFTS = [no_drift, *(SAFE_DRIFTS[n] for n in ("args_keys_reordered", "tools_reordered", "tool_results_reordered", "null_fields", "varying"))]
TURNS = 5
KINDS = ("affinity", "spill", "new", "failover")


async def instances(make_proxy: ProxyFactory, pool: Sequence[TestServer], url: str, prefix: str, **overrides: Any) -> list[TestServer]:
    """Two kvwarm instances on the Redis at ``url`` over ``pool``; the second lists it backwards."""
    urls = [sim_url(s) for s in pool]
    shared = {"store__backend": url, "store__redis_prefix": prefix, "store__secret": "shared-secret", "store__timeout": 2.0}
    return [
        await make_proxy(order[0], upstream__base_url=order, **shared, **overrides)
        for order in (urls, urls[::-1])
    ]


def switching(servers: Sequence[TestServer], start: int = 0, headers: dict[str, str] | None = None) -> Post:
    """An agent's ``post`` that sends each request to the next instance in turn (a balancer)."""
    posts = [poster(s, headers=headers) for s in servers]
    sent = start

    async def post(body: dict[str, Any]) -> dict[str, Any]:
        nonlocal sent
        sent += 1
        return await posts[(sent - 1) % len(posts)](body)

    return post


def decisions(servers: Sequence[TestServer]) -> dict[str, float]:
    return {k: sum(metric(s, "kvwarm_routing_decisions_total", kind=k) for s in servers) for k in KINDS}


def affinity_of(server: TestServer) -> RedisAffinity:
    table = router_of(server).affinity
    assert isinstance(table, RedisAffinity), "a pool on a shared store routes by the store's affinity"
    return table


@pytest.mark.parametrize("backend", ["redis", "cluster"])
async def test_every_turn_of_a_session_lands_on_one_replica_whichever_instance_serves_it(
    request: pytest.FixtureRequest, backend: str, make_sim: Any, make_proxy: ProxyFactory
) -> None:
    server: RedisServer | RedisClusterProcesses = request.getfixturevalue(backend)
    pool = [await make_sim() for _ in range(3)]
    prefix = f"t{uuid.uuid4().hex[:10]}"
    a, b = await instances(make_proxy, pool, server.url, prefix, routing__affinity_ttl_seconds=120.0)
    agents = [session_agent(i, None, prompt=0, drift=DRIFTS[i]) for i in range(len(DRIFTS))]

    # Six sessions of one system prompt start at once on instance a, held in flight: bounded
    # load spreads them over the pool, so several have a home rendezvous hashing would not pick.
    for agent in agents:
        agent.post = switching([a], headers={"x-sim-fault": "delay=0.4"})
    await asyncio.gather(*(agent.step() for agent in agents))
    first = decisions([a])
    # Then one request at a time (no load), each session alternating b, a, b, a.
    for agent in agents:
        agent.post = switching([b, a])
    for _ in range(TURNS - 1):
        for agent in agents:
            await agent.step()

    homes = served(pool)
    assert sorted(homes) == list(range(len(agents)))
    assert all(len(where) == TURNS and len(set(where)) == 1 for where in homes.values()), homes
    assert len({where[0] for where in homes.values()}) >= 2, f"the first turns did not spread: {first}"
    assert first["spill"] + first["new"] == len(agents)
    # Every later turn went home by the shared table, on b (which never saw a first turn) as on a.
    later = (TURNS - 1) * len(agents)
    assert decisions([a, b]) == {**first, "affinity": later}
    assert metric(b, "kvwarm_routing_decisions_total", kind="affinity") == later / 2
    # A drifting agent is repaired on either instance and found at home: a cache hit there.
    for agent in agents:
        for turn in agent.turns[1:]:
            assert turn.cached >= 0.8 * turn.prompt, (agent.drift.__name__, turn.cached, turn.prompt)
    # The table was read in the fills' round trips: a look-up of its own is the exception.
    tables = [affinity_of(a), affinity_of(b)]
    prefetched = sum(t.counters.prefetched for t in tables)
    fetched = sum(t.counters.fetched for t in tables)
    assert prefetched >= later - len(agents) and fetched <= len(agents), (prefetched, fetched)
    assert sum(t.counters.errors for t in tables) == 0
    # One key per prefix in the tenant's slot, naming a replica, with its own short TTL.
    nodes = server.nodes if isinstance(server, RedisClusterProcesses) else [server]
    entries = [(n, name) for n in nodes for name in n.cli("--scan", "--pattern", f"{prefix}:{{*}}:r:*").split()]
    assert len(entries) >= later
    assert len({name.split("}")[0] for _, name in entries}) == 1, "one tenant: one hash tag"
    replicas = {sim_url(s) for s in pool}
    for node, name in entries[:20]:
        assert node.cli("GET", name) in replicas
        assert 0 < int(node.cli("PTTL", name)) <= 120_000


async def test_redis_down_falls_back_to_rendezvous_and_no_request_fails(
    tmp_path: Any, make_sim: Any, make_proxy: ProxyFactory
) -> None:
    why = binaries_missing()
    if why is not None:
        pytest.skip(why)
    server = RedisServer(tmp_path / "redis").start()
    try:
        pool = [await make_sim() for _ in range(3)]
        pair = await instances(make_proxy, pool, server.url, f"t{uuid.uuid4().hex[:10]}")
        # Four sessions, each its own system prompt: rendezvous places them over the pool.
        agents = [session_agent(i, switching(pair, start=i), prompt=i, drift=DRIFTS[i]) for i in range(4)]
        for _ in range(2):
            for agent in agents:
                await agent.step()
        before = decisions(pair)
        assert before["affinity"] == len(agents)

        server.kill()
        await asyncio.sleep(PREFETCH_SECONDS + 0.1)  # what the instances read last is stale now
        for _ in range(2):
            for agent in agents:
                turn = await agent.step()  # every request succeeds (the poster checks the status)
                assert turn.response["choices"][0]["message"]
        down = decisions(pair)
        # Each look-up failed (counted, never raised): placed as a new session, by rendezvous.
        assert down == {**before, "new": before["new"] + 2 * len(agents)}
        assert sum(affinity_of(p).counters.errors for p in pair) >= 2 * len(agents)
        assert sum(metric(p, "kvwarm_errors_total", stage="routing") for p in pair) == 0
        # Rendezvous is the same computation in both instances: a session still has one replica.
        homes = served(pool)
        assert all(len(set(where[2:])) == 1 for where in homes.values()), homes

        server.start()  # same port, empty: the instances reconnect by themselves
        for p in pair:
            for _ in range(50):
                async with aiohttp.ClientSession() as s, s.get(p.make_url("/readyz")) as r:
                    if (await r.json())["status"] == "ready":
                        break
                await asyncio.sleep(0.1)
        for _ in range(2):
            for agent in agents:
                await agent.step()
        # The table is written again: the last round went home by it.
        assert decisions(pair)["affinity"] >= before["affinity"] + len(agents)
        homes = served(pool)
        assert all(len(set(where[4:])) == 1 for where in homes.values()), homes
    finally:
        server.stop()
