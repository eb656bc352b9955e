"""Transcripts through the whole proxy: tenants, concurrency, persistence, corruption, fail open."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
from aiohttp.test_utils import TestServer

from proxy.core.plan import TurnPlan
from proxy.sim.render import render_tokens
from proxy.store.memory.store import MemoryStore
from proxy.transport.traits import UpstreamTraits
from proxy.wire.base import Outgoing
from proxy.wire.chat import ChatWire
from tests.agents import USER_TURNS, Agent, args_keys_reordered, tools_reordered, varying
from tests.conftest import ProxyFactory, metric, poster, received, store_of


def forwarded(sim: TestServer) -> list[dict[str, Any]]:
    return [orjson.loads(r.body) for r in received(sim)]


def repaired_count(turn: Any) -> int:
    return int(turn.response["_headers"]["x-kvwarm-prefix"].split("repaired=")[1].split(";")[0])


async def test_tenants_never_share_nodes_or_bytes(make_sim: Any, make_proxy: ProxyFactory) -> None:
    sim = await make_sim()
    proxy = await make_proxy(sim)
    alice = Agent(poster(proxy, key="sk-alice"))
    await alice.run(3)
    store = store_of(proxy)
    nodes_after_alice = store.stats().nodes
    # Bob replays Alice's exact conversation with re-serialized arguments and rotated tools:
    # nothing of Alice's may be used to "repair" Bob's request.
    bob = Agent(poster(proxy, key="sk-bob"), drift=args_keys_reordered)
    bob.history, bob.sent = [dict(m) for m in alice.history], len(alice.history) - 1
    bob.turns = list(alice.turns)  # so the drift applies (turn > 0)
    before = len(received(sim))
    turn = await bob.step()
    assert repaired_count(turn) == 0
    assert turn.response["_headers"]["x-kvwarm-prefix"].startswith("matched=0/")
    assert received(sim)[before].body == orjson.dumps(turn.request)
    tenants = {s.tenant for s in store.sessions()}
    assert len(tenants) == 2
    assert store.stats().nodes > nodes_after_alice  # Bob got his own nodes, even for identical messages


async def test_fifty_concurrent_sessions_with_forks_keep_their_own_transcripts(make_sim: Any, make_proxy: ProxyFactory) -> None:
    kv_sim, clean_sim = await make_sim(), await make_sim()
    proxy = await make_proxy(kv_sim)

    def turns_for(i: int) -> list[str]:
        # Groups of five share a first question (sub-agents forked from one point), then diverge.
        return [f"Task group {i // 5}: {USER_TURNS[0]}", f"Agent {i}: {USER_TURNS[1]}", *USER_TURNS[2:]]

    warm = [Agent(poster(proxy, key="sk-team"), drift=varying, user_turns=turns_for(i)) for i in range(50)]
    clean = [Agent(poster(clean_sim, key="sk-team"), user_turns=turns_for(i)) for i in range(50)]
    await asyncio.gather(*(a.run(4) for a in warm))
    for a in clean:  # sequentially: the reference for what each session must have been sent
        await a.run(4)
    for w, c in zip(warm, clean, strict=True):
        for tw, tc in zip(w.turns, c.turns, strict=True):
            assert tw.response["choices"][0]["message"] == tc.response["choices"][0]["message"]
        # Every re-sent message was found: no node lost. (A fork may match more than it re-sent:
        # a sibling that got there first already stored the same next messages.)
        for t in w.turns[1:]:
            matched = int(t.response["_headers"]["x-kvwarm-prefix"].split("matched=")[1].split("/")[0])
            assert matched >= t.resent
    # What the upstream received through kvwarm is, per session, what a clean client sends.
    want = sorted(orjson.dumps(render_tokens(b["messages"], b.get("tools"))) for b in forwarded(clean_sim))
    got = sorted(orjson.dumps(render_tokens(b["messages"], b.get("tools"))) for b in forwarded(kv_sim))
    assert got == want
    assert metric(proxy, "kvwarm_errors_total", stage="record") == 0


async def test_sqlite_store_survives_restart_between_turns(tmp_path: Path, make_sim: Any, make_proxy: ProxyFactory) -> None:
    db = tmp_path / "kv.db"
    kv_sim, clean_sim = await make_sim(cache_mode="vllm"), await make_sim(cache_mode="vllm")
    first = await make_proxy(kv_sim, store__backend=f"sqlite:{db}")
    agent = Agent(poster(first), drift=tools_reordered)
    await agent.run(2)
    await first.close()  # cleanup_ctx flushes and closes the store

    second = await make_proxy(kv_sim, store__backend=f"sqlite:{db}")
    agent.post = poster(second)
    third = await agent.step()
    clean = await Agent(poster(clean_sim)).run(3)
    assert repaired_count(third) > 0
    assert third.response["_headers"]["x-kvwarm-prefix"].startswith(f"matched={third.resent}/")
    last = forwarded(kv_sim)[-1]
    assert render_tokens(last["messages"], last["tools"]) == render_tokens(clean[2].request["messages"], clean[2].request["tools"])
    assert third.cached == clean[2].cached


async def test_corrupted_row_is_a_counted_miss(tmp_path: Path, make_sim: Any, make_proxy: ProxyFactory) -> None:
    db = tmp_path / "kv.db"
    sim = await make_sim()
    first = await make_proxy(sim, store__backend=f"sqlite:{db}")
    agent = Agent(poster(first), drift=tools_reordered)
    await agent.run(2)
    await first.close()
    with sqlite3.connect(db) as conn:  # damage every stored tools array (element 0)
        changed = conn.execute("UPDATE blobs SET data = CAST('{broken' AS BLOB) WHERE hash IN (SELECT body_hash FROM nodes WHERE depth = 0)").rowcount
    assert changed >= 1

    second = await make_proxy(sim, store__backend=f"sqlite:{db}")
    agent.post = poster(second)
    before = len(received(sim))
    turn = await agent.step()  # must succeed: a miss, never a crash or a partial transcript
    assert turn.response["_headers"]["x-kvwarm-prefix"].startswith("matched=0/")
    assert repaired_count(turn) == 0
    assert received(sim)[before].body == orjson.dumps(turn.request)
    assert store_of(second).stats().corrupt >= 1


class FailingStore(MemoryStore):
    """A real store whose reads or writes raise, to prove kvwarm fails open."""

    def __init__(self, fail: str) -> None:
        super().__init__(ttl_seconds=3600, max_bytes=1 << 30)
        self.fail = fail

    def get(self, key: bytes) -> Any:
        if self.fail == "get":
            raise RuntimeError("store read exploded")
        return super().get(key)

    def insert(self, nodes: Any) -> int:
        if self.fail == "insert":
            raise OSError("disk full")
        return super().insert(nodes)


async def test_failing_store_reads_forward_the_original_request(sim: TestServer, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(sim, store=FailingStore("get"))
    agent = Agent(poster(proxy), drift=args_keys_reordered)
    await agent.run(3)
    for turn, req in zip(agent.turns, received(sim), strict=True):
        assert req.body == orjson.dumps(turn.request)
        assert turn.response["choices"][0]["message"]
    assert metric(proxy, "kvwarm_errors_total", stage="match") == 3


async def test_failing_store_writes_still_serve_the_response(sim: TestServer, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(sim, store=FailingStore("insert"))
    turns = await Agent(poster(proxy)).run(2)
    assert all(t.response["choices"][0]["message"] for t in turns)
    assert metric(proxy, "kvwarm_errors_total", stage="record") == 2


class UnserializingWire(ChatWire):
    """The chat front-end whose repaired bytes cannot be written (the planner and the splicer
    are compiled: a fault is injected where plain Python can reach, the wire's ``outgoing``)."""

    failures = 0

    def outgoing(self, raw: bytes, body: Mapping[str, Any], plan: TurnPlan, traits: UpstreamTraits) -> Outgoing:
        if plan.repair.repairs:
            UnserializingWire.failures += 1
            raise TypeError("cannot serialize")
        return super().outgoing(raw, body, plan, traits)


async def test_a_failing_serialization_forwards_the_original_bytes(sim: TestServer, make_proxy: ProxyFactory, monkeypatch: Any) -> None:
    monkeypatch.setattr("proxy.request.parser.WIRES", (UnserializingWire(),))
    UnserializingWire.failures = 0
    proxy_server = await make_proxy(sim)
    turns = await Agent(poster(proxy_server), drift=args_keys_reordered).run(3)
    # Drifted turns: repair planned, writing it failed, the original bytes went.
    assert UnserializingWire.failures >= 1
    assert [r.body for r in received(sim)] == [orjson.dumps(t.request) for t in turns]
    assert metric(proxy_server, "kvwarm_errors_total", stage="repair") == UnserializingWire.failures
