"""When a session leaves its home: never at low load; under a large absolute imbalance, once.

Moving a session costs a prefill of its whole history on the new replica; a few more requests
in flight on an engine that batches cost little. So ``prefix`` routing moves a session only
when its home is overloaded in relative terms (``routing.max_load_factor``) *and* holds more
than ``routing.balance_abs_threshold`` requests beyond the least-loaded replica; the replica
it moves to is its home from then on.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from aiohttp.test_utils import TestServer

from tests.agents import SAFE_DRIFTS, Agent, no_drift
from tests.conftest import ProxyFactory, received
from tests.demo.run import sdk_post
from tests.routing.conftest import SESSION, PooledFactory, PoolFactory, session_agent
from tests.routing.test_affinity import decisions

SESSIONS = 8
TURNS = 20
VLLM = {"cache_mode": "vllm", "ttft_base": 0.02}
"""The reference upstream caching every 16-token block of prompts and replies, as vLLM does;
the first-token delay keeps the sessions' requests in flight together."""
DRIFTS = [no_drift, SAFE_DRIFTS["varying"], no_drift, SAFE_DRIFTS["resumed"]]
RUN_TIMEOUT = 60.0


def agents(clients: Sequence[Any]) -> list[Agent]:
    """Session ``i`` through ``clients[i]``: two system prompts, every other session re-serializing
    its history (kvwarm repairs it, and routes it by the repaired identity)."""
    return [
        session_agent(i, sdk_post(client), prompt=i % 2, drift=DRIFTS[i % len(DRIFTS)])
        for i, client in enumerate(clients)
    ]


async def cached_per_session(sessions: Sequence[Agent]) -> list[int]:
    """The sessions run concurrently, each one request at a time: each one's cached prompt tokens."""
    await asyncio.wait_for(asyncio.gather(*(a.run(TURNS) for a in sessions)), RUN_TIMEOUT)
    return [sum(turn.cached for turn in a.turns) for a in sessions]


def replicas_by_turn(replicas: Sequence[TestServer], marker: re.Pattern[bytes]) -> dict[int, list[int]]:
    """Session (``marker``'s number) -> the replica of each of its requests, in turn order (a
    session's request grows every turn)."""
    seen: dict[int, list[tuple[int, int]]] = {}
    for index, replica in enumerate(replicas):
        for r in received(replica):
            found = marker.search(r.body)
            if found:
                seen.setdefault(int(found.group(1)), []).append((len(r.body), index))
    return {s: [index for _, index in sorted(turns)] for s, turns in seen.items()}


async def test_eight_sessions_on_four_replicas_keep_their_one_replica_cache(
    make_pool: PoolFactory, make_pooled: PooledFactory, make_proxy: ProxyFactory, openai_client: Any
) -> None:
    replicas = await make_pool(4, **VLLM)
    kvwarm = await make_pooled(replicas, log__level="WARNING")  # the shipped routing settings
    pooled = await cached_per_session(agents([openai_client(kvwarm)] * SESSIONS))

    # The same sessions, each alone in front of a replica of its own: what it caches when
    # nothing ever moves it (and no other session warms its replica).
    singles = await make_pool(SESSIONS, **VLLM)
    fronts = [await make_proxy(single, log__level="WARNING") for single in singles]
    alone = await cached_per_session(agents([openai_client(front) for front in fronts]))

    where = replicas_by_turn(replicas, SESSION)
    assert sorted(where) == list(range(SESSIONS)) and all(len(w) == TURNS for w in where.values())
    moved = {s: w for s, w in where.items() if len(set(w)) > 1}
    assert moved == {}, f"sessions moved between replicas: {moved}"
    assert decisions(kvwarm) == {"affinity": SESSIONS * (TURNS - 1), "spill": 0, "new": SESSIONS, "failover": 0}
    kept = {s: pooled[s] / alone[s] for s in range(SESSIONS)}
    assert min(kept.values()) >= 0.995, kept


BURST = 40
"""Requests forking one conversation at once: more than ``balance_abs_threshold`` (32) + 1."""
BRANCH = re.compile(rb"Branch (\d+):")


def fork(trunk: Agent, branch: int, post: Any) -> Agent:
    """A new conversation continuing ``trunk``'s history (a sub-agent, a retry with another ask)."""
    history = [dict(m) for m in trunk.history] + [{"role": "user", "content": f"Branch {branch}: try another way."}]
    return Agent(post, system=trunk.system, user_turns=trunk.user_turns, history=history, sent=trunk.sent)


async def test_a_large_absolute_imbalance_spills_and_the_new_home_sticks(
    make_pool: PoolFactory, make_pooled: PooledFactory, openai_client: Any
) -> None:
    replicas = await make_pool(4, cache_mode="vllm")
    kvwarm = await make_pooled(replicas, log__level="WARNING")  # max_load_factor 1.25, balance_abs_threshold 32
    client = openai_client(kvwarm)
    trunk = session_agent(0, sdk_post(client))
    await trunk.step()
    (home,) = {i for i, r in enumerate(replicas) if received(r)}

    # BURST branches of the conversation at once, all held in flight (none answers before the
    # last arrives). Home takes 33: then it holds 33 > 32 beyond the idle replicas, so the next
    # three spill, one to each of them; home takes one more (33 - 1 = 32 is not > 32), and
    # holding 34 - 1 = 33 beyond them, sees the last three spill again.
    held = sdk_post(client, extra_headers={"x-sim-fault": "delay=3"})
    branches = [fork(trunk, j, held) for j in range(BURST)]
    await asyncio.wait_for(asyncio.gather(*(b.step() for b in branches)), RUN_TIMEOUT)
    first = {j: w[0] for j, w in replicas_by_turn(replicas, BRANCH).items()}
    assert len(first) == BURST
    assert Counter(first.values()) == {i: 34 if i == home else 2 for i in range(4)}, first
    assert decisions(kvwarm) == {"affinity": 34, "spill": 6, "new": 1, "failover": 0}

    # One at a time now, no load at all: a branch that moved stays where it moved to (the
    # affinity followed it), it does not go back to the now idle replica it left.
    for b in branches:
        b.post = sdk_post(client)
        await asyncio.wait_for(b.step(), RUN_TIMEOUT)
    where = replicas_by_turn(replicas, BRANCH)
    assert {j: w[1] for j, w in where.items()} == first
    assert decisions(kvwarm) == {"affinity": 34 + BURST, "spill": 6, "new": 1, "failover": 0}
