"""A small run of the routing benchmark (tests/bench/routing.py): `prefix` keeps nearly all of an
unbounded single replica's cached tokens on a pool whose replicas each hold a quarter of them."""

from __future__ import annotations

from tests.bench.routing import Workload, compare


async def test_prefix_routing_keeps_the_cache_that_round_robin_loses() -> None:
    workload = Workload(sessions=16, prompts=4, turns=8)
    ideal, results, capacity = await compare(workload, ("prefix", "round_robin"))
    prefix, spread = results["prefix"], results["round_robin"]
    assert ideal.cached > 0 and capacity > 0
    assert prefix.prompt == spread.prompt == ideal.prompt, "the same workload each time"
    assert prefix.cached >= 0.9 * ideal.cached, (prefix.cached, ideal.cached)
    # round_robin keeps 0.60-0.73 of the ideal across runs (the order requests arrive in), prefix
    # 0.93-0.98 (fewer when a loaded machine makes it spill): a margin of 0.15 holds for both.
    assert prefix.cached >= spread.cached + 0.15 * ideal.cached, (prefix.cached, spread.cached)
    assert sum(prefix.per_replica) == workload.sessions * workload.turns
    assert prefix.spread <= 1.5, prefix.per_replica
    assert prefix.decisions.get("new") == workload.sessions and not prefix.decisions.get("failover")
