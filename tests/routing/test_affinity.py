"""Prefix affinity over a pool of reference upstreams: sessions stay home, new ones go by rendezvous,
bounded load spills; drifting agents (tests/agents.py) keep their home by their repaired identity."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from tests.agents import SAFE_DRIFTS
from tests.conftest import metric, received
from tests.demo.run import sdk_post
from tests.routing.conftest import (
    PooledFactory,
    PoolFactory,
    router_of,
    served,
    session_agent,
    turns_at,
)

DRIFTS = ["varying", "resumed", "tools_reordered", "args_keys_reordered"]


def decisions(kvwarm: Any) -> dict[str, float]:
    kinds = ("affinity", "spill", "new", "failover")
    return {k: metric(kvwarm, "kvwarm_routing_decisions_total", kind=k) for k in kinds}


async def test_every_session_stays_home_drifting_agents_included(
    make_pool: PoolFactory, make_pooled: PooledFactory, openai_client: Any
) -> None:
    replicas = await make_pool(4)
    # No spill here (a huge load factor): where each turn goes is affinity alone.
    kvwarm = await make_pooled(replicas, routing__max_load_factor=1000.0)
    client = openai_client(kvwarm)
    agents = [
        session_agent(i, sdk_post(client), prompt=i, drift=SAFE_DRIFTS[DRIFTS[i // 2 % 4]] if i % 2 else SAFE_DRIFTS["null_fields"])
        for i in range(8)
    ]
    await asyncio.gather(*(a.run(4) for a in agents))

    homes = served(replicas)
    assert sorted(homes) == list(range(8))
    assert all(len(set(where)) == 1 and len(where) == 4 for where in homes.values()), homes
    assert len({where[0] for where in homes.values()}) >= 2, "8 system prompts spread over the replicas"
    assert decisions(kvwarm) == {"affinity": 24, "spill": 0, "new": 8, "failover": 0}
    # Each drifting agent is repaired and found at home: every later turn is a cache hit there.
    for agent in agents:
        for turn in agent.turns[1:]:
            assert turn.cached >= 0.8 * turn.prompt, (agent.drift.__name__, turn.cached, turn.prompt)
    # The per-replica counters are the replicas' own counts.
    for r in router_of(kvwarm).replicas:
        assert metric(kvwarm, "kvwarm_upstream_requests_total", upstream=r.label) == len(received(replicas[r.index]))


async def test_new_sessions_sharing_a_system_prompt_share_a_replica(
    make_pool: PoolFactory, make_pooled: PooledFactory, openai_client: Any
) -> None:
    replicas = await make_pool(4)
    kvwarm = await make_pooled(replicas)
    client = openai_client(kvwarm)
    agents = [session_agent(i, sdk_post(client), prompt=i % 2) for i in range(8)]
    for agent in agents:  # one at a time: no load, rendezvous alone decides
        await agent.step()

    homes = served(replicas)
    by_prompt = {p: {homes[i][0] for i in range(p, 8, 2)} for p in (0, 1)}
    assert all(len(where) == 1 for where in by_prompt.values()), by_prompt
    # The co-located sessions found their system prompt cached by the first of them.
    for agent in agents[2:]:
        assert agent.turns[0].cached >= 2048, agent.turns[0].usage
    assert decisions(kvwarm)["new"] == 8


async def test_an_overloaded_home_spills_and_the_new_replica_becomes_home(
    make_pool: PoolFactory, make_pooled: PooledFactory, openai_client: Any
) -> None:
    replicas = await make_pool(4)
    # max_load_factor 1.25 alone (no absolute margin): the bounded-load arithmetic, at small scale.
    kvwarm = await make_pooled(replicas, routing__balance_abs_threshold=0)
    client = openai_client(kvwarm)

    def post(turn: int, delay: float = 0.0) -> Any:
        headers = {"x-test-turn": str(turn)}
        if delay:
            headers["x-sim-fault"] = f"delay={delay}"
        return sdk_post(client, extra_headers=headers)

    agents = [session_agent(i, post(0), prompt=0) for i in range(4)]
    for agent in agents:  # four sessions of one system prompt: all on its replica
        await agent.step()
    for agent in agents:  # all four at once, held in flight: the home takes its share, the rest spill
        agent.post = post(1, delay=0.4)
    await asyncio.gather(*(a.step() for a in agents))
    for agent in agents:  # one at a time again: each goes to the home it has now
        agent.post = post(2)
        await agent.step()

    at = turns_at(replicas)
    first = {at[(i, 0)] for i in range(4)}
    assert len(first) == 1
    (home,) = first
    second = Counter(at[(i, 1)] for i in range(4))
    # Capacity ceil(1.25 * (m + 1) / 4) for m in flight: 1, 1, 1, 2 -> home, spill, spill, home.
    assert second[home] == 2 and len(second) == 3 and max(second.values()) == 2, second
    assert all(at[(i, 2)] == at[(i, 1)] for i in range(4)), at
    assert decisions(kvwarm) == {"affinity": 2 + 4, "spill": 2, "new": 4, "failover": 0}
