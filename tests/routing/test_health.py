"""Passive health over real sockets: a refused replica is failed over and ejected, a 5xx burst
ejects, and an ejected replica comes back through one probe."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import openai
import pytest

from tests.conftest import metric, received, sim_url
from tests.demo.run import sdk_post
from tests.routing.conftest import PooledFactory, PoolFactory, router_of, served, session_agent


async def test_a_refused_replica_is_failed_over_and_ejected(
    make_pool: PoolFactory, make_pooled: PooledFactory, openai_client: Any, closed_port_url: Callable[[], str]
) -> None:
    (alive,) = await make_pool(1)
    dead = closed_port_url()
    kvwarm = await make_pooled([dead, alive])
    client = openai_client(kvwarm)
    agents = [session_agent(i, sdk_post(client), prompt=i) for i in range(6)]
    await asyncio.gather(*(a.run(2) for a in agents))  # no request fails

    assert len(received(alive)) == 12
    router = router_of(kvwarm)
    down, up = router.replicas
    assert [d["state"] for d in router.describe()] == ["ejected", "healthy"]
    assert metric(kvwarm, "kvwarm_upstream_ejections_total", upstream=down.label) == 1
    assert metric(kvwarm, "kvwarm_upstream_requests_total", upstream=down.label) == 0, "nothing reached it"
    assert metric(kvwarm, "kvwarm_upstream_requests_total", upstream=up.label) == 12
    # At most the requests placed on it before its ejection were failed over (once ejected, none go there).
    assert 1 <= metric(kvwarm, "kvwarm_routing_decisions_total", kind="failover") <= 6


async def test_with_every_replica_down_the_request_fails_once_each_was_tried(
    make_pooled: PooledFactory, closed_port_url: Callable[[], str]
) -> None:
    kvwarm = await make_pooled([closed_port_url(), closed_port_url()])
    client = openai.AsyncOpenAI(base_url=str(kvwarm.make_url("/v1")), api_key="sk-x", max_retries=0)
    try:
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    finally:
        await client.close()
    assert info.value.status_code == 502
    assert metric(kvwarm, "kvwarm_routing_decisions_total", kind="failover") == 1
    assert [d["state"] for d in router_of(kvwarm).describe()] == ["ejected", "ejected"]


async def test_a_5xx_burst_ejects_home_and_a_probe_brings_it_back(
    make_pool: PoolFactory, make_pooled: PooledFactory, openai_client: Any
) -> None:
    replicas = await make_pool(2)
    kvwarm = await make_pooled(replicas, routing__eject_seconds=0.5)
    client = openai_client(kvwarm)
    router = router_of(kvwarm)
    first = session_agent(0, sdk_post(client), prompt=0)
    await first.step()
    home = served(replicas)[0][0]
    label = router.replicas[home].label

    failing = first.next_request()
    for _ in range(3):  # three server errors at home within 10 s
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(**failing, extra_headers={"x-sim-fault": "status=500"})
    assert metric(kvwarm, "kvwarm_upstream_ejections_total", upstream=label) == 1
    assert router.describe()[home]["state"] == "ejected"

    await first.step()  # home is ejected: the other replica takes the session, and keeps it
    await first.step()
    assert Counter(served(replicas)[0]) == {home: 1 + 3, 1 - home: 2}  # turn 1 and the 500s at home
    assert metric(kvwarm, "kvwarm_routing_decisions_total", kind="spill") == 1

    await asyncio.sleep(0.6)
    assert router.describe()[home]["state"] == "half-open"
    before = len(received(replicas[home]))
    second = session_agent(1, sdk_post(client), prompt=0)  # same system prompt: rendezvous picks `home`
    await second.step()
    assert len(received(replicas[home])) == before + 1, "the probe"
    assert router.describe()[home]["state"] == "healthy"
    assert metric(kvwarm, "kvwarm_routing_decisions_total", kind="new") == 2
    # Not a sim URL leaks into a label: host:port only.
    assert label == sim_url(replicas[home]).split("//")[1].removesuffix("/v1")
