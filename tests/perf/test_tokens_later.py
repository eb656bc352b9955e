"""Token counts of a turn's small nodes are made when they are read, not on every turn.

A turn's nodes are written before the response's last byte. With a local store (memory,
sqlite) they are written uncounted (:data:`~proxy.store.tokens.LATER`), and their counts
(tiktoken, CPU work: a new session's 10 KiB system prompt costs over a millisecond) are made
when something reads them: a repair's rescued tokens (before its response) or a session's
view. A shared store (Redis) has them counted before the write. Checked here:

* the store's fill replaces the node everywhere it is indexed, and its byte accounting is what
  a store built with the counted nodes holds;
* end to end (kvwarm, the reference upstream, agents drifting in two ways, both local stores):
  no stored count is ever wrong, nodes nobody read stay uncounted (a large one too), ``rescued=`` in the
  header is the exact sum of the counts of the nodes it names, and a session's view (JSON and
  Markdown) has every count, which the store then keeps (sqlite: in its file);
* with Redis, every node is counted when written (the agent's large system prompt in a worker
  thread), and ``rescued=`` is exact;
* a repair planned while the nodes it rescues are uncounted still reports the exact count,
  counted on the event loop when they are small and in a worker thread when they are not, and
  counted once;
* the store decides (``AsyncStore.token_counts``), not the pipeline from the store's class: a
  store of another class that counts later has its nodes written uncounted and counted when read.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.app import PIPELINE
from proxy.core import transcript_md
from proxy.core.match import tenant_root
from proxy.core.model import TurnWrite
from proxy.core.plan import TurnPlan, plan_turn, turn_write
from proxy.core.policy import Policy
from proxy.core.record import Reply
from proxy.request.pipeline import Pipeline
from proxy.request.turn import Turn
from proxy.store.local import LocalStore
from proxy.store.memory.store import MemoryStore
from proxy.store.redis.store import RedisStore
from proxy.store.tokens import INLINE_TOKENIZE_BYTES, LATER, TokenCounter
from tests.agents import Agent, args_python_dumps, whitespace_stripped
from tests.conftest import ProxyFactory, poster, store_of
from tests.store.redis_server import RedisServer

SECRET = b"t" * 32
ROOT = tenant_root(SECRET, "Bearer sk-alice")
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
COUNTER = TokenCounter()


def first_turn(query: str = "cache key") -> tuple[dict[str, Any], dict[str, Any]]:
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": orjson.dumps({"q": query}).decode()}}
    body = {"model": "m", "tools": TOOLS, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find it."}]}
    return body, {"role": "assistant", "content": None, "tool_calls": [call]}


def written_uncounted(store: LocalStore, body: dict[str, Any], reply: dict[str, Any], root: bytes = ROOT) -> TurnWrite:
    plan = plan_turn(body, root, store.view(root), Policy())
    turn = turn_write(plan, Reply(message=reply, finish_reason="tool_calls", partial=False, model="m"), None, None, model="m", client_gone=False, now=time.time(),
                      count_tokens=lambda body: LATER)
    assert turn is not None
    store.write_turn_now(turn)
    return turn


def test_a_fill_reaches_every_index_and_the_accounting() -> None:
    store = LocalStore(MemoryStore(3600, 1 << 30, secret=SECRET))
    assert store.fills_tokens
    nodes = written_uncounted(store, *first_turn()).nodes
    memory = store.local
    assert isinstance(memory, MemoryStore)
    assert all(memory.get(n.key).tokens == LATER for n in nodes)  # type: ignore[union-attr]
    counts = {n.key: COUNTER.count_body(n.body) for n in nodes}
    assert store.fill_tokens(counts) == len(nodes)
    assert store.fill_tokens(counts) == 0, "a count is filled in once"
    for n in nodes:
        stored = memory.get(n.key)
        assert stored is not None and stored.tokens == counts[n.key] > 0
        assert any(c is stored for c in memory.children(n.parent))
        assert any(c is stored for c in memory.by_identity(n.tenant, n.identity))
    assert [n.tokens for n in memory.path(nodes[-1].key)] == [counts[n.key] for n in nodes]
    # The same turn written counted from the start holds the same bytes.
    counted = LocalStore(MemoryStore(3600, 1 << 30, secret=SECRET))
    body, reply = first_turn()
    plan = plan_turn(body, ROOT, counted.view(ROOT), Policy())
    turn = turn_write(plan, Reply(message=reply, finish_reason="tool_calls", partial=False, model="m"), None, None, model="m", client_gone=False, now=time.time(),
                      count_tokens=COUNTER.count_body)
    assert turn is not None
    counted.write_turn_now(turn)
    assert counted.stats().bytes == store.stats().bytes


def rescues_seen(pipeline: Pipeline) -> list[tuple[TurnPlan, TurnPlan]]:
    """Every (plan, plan with exact rescued tokens) the pipeline makes, in order."""
    seen: list[tuple[TurnPlan, TurnPlan]] = []
    exact_rescue = pipeline.tokens.exact_rescue

    async def recorded(plan: TurnPlan, view: Any) -> TurnPlan:
        exact = await exact_rescue(plan, view)
        seen.append((plan, exact))
        return exact

    pipeline.tokens.exact_rescue = recorded  # type: ignore[method-assign]
    return seen


def plans_seen(pipeline: Pipeline) -> list[TurnPlan]:
    """Every request's plan, in order."""
    planned: list[TurnPlan] = []
    plan = pipeline.plan

    async def recorded(turn: Turn) -> None:
        await plan(turn)
        assert turn.plan is not None
        planned.append(turn.plan)

    pipeline.plan = recorded  # type: ignore[method-assign]
    return planned


def counting_threads(pipeline: Pipeline) -> list[int]:
    """The thread of every batch of token counts the pipeline makes, in order."""
    threads: list[int] = []
    count = pipeline.tokens._count

    def counting(bodies: list[bytes]) -> list[int]:
        threads.append(threading.get_ident())
        return count(bodies)

    pipeline.tokens._count = counting  # type: ignore[method-assign]
    return threads


def rescued_headers(headers: list[dict[str, str]]) -> list[int]:
    return [int(h["x-kvwarm-prefix"].split("rescued=")[1].split(";")[0]) for h in headers if "rescued=" in h["x-kvwarm-prefix"]]


def rescued_nodes(plan: TurnPlan) -> tuple[Any, ...]:
    assert plan.match is not None
    return plan.match.nodes[min(r.depth for r in plan.repair.repairs) :]


def exact_sum(plan: TurnPlan) -> int:
    return sum(COUNTER.count_body(n.body) for n in rescued_nodes(plan))


def uncounted_in(plan: TurnPlan) -> bool:
    return any(n.tokens < 0 for n in rescued_nodes(plan))


async def get(server: TestServer, path: str) -> bytes:
    async with aiohttp.ClientSession() as s, s.get(server.make_url(path)) as r:
        assert r.status == 200, await r.text()
        return await r.read()


@pytest.mark.parametrize("drift", [args_python_dumps, whitespace_stripped])
@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_a_local_store_counts_what_is_read_and_exactly(
    make_proxy: ProxyFactory, sim: TestServer, tmp_path: Path, backend: str, drift: Any
) -> None:
    db = tmp_path / "k.db"
    kvwarm = await make_proxy(sim, store__backend=backend if backend == "memory" else f"sqlite:{db}")
    pipeline = kvwarm.app[PIPELINE]
    seen = rescues_seen(pipeline)
    store = store_of(kvwarm)
    assert isinstance(pipeline.store, LocalStore) and pipeline.store.fills_tokens
    headers: list[dict[str, str]] = []
    post = poster(kvwarm)

    async def checked(body: dict[str, Any]) -> dict[str, Any]:
        response = await post(body)
        headers.append(response["_headers"])
        for node in store._nodes.values():  # uncounted, or counted right
            assert node.tokens in (LATER, COUNTER.count_body(node.body)), node.role
        return response

    await Agent(post=checked, drift=drift).run(5)
    assert len(seen) >= 3, "the drifting agent's repairs rescue tokens"
    assert any(uncounted_in(plan) for plan, _ in seen), "planned over uncounted nodes"
    for plan, exact in seen:
        assert exact == replace(plan, repair=replace(plan.repair, rescued_tokens=exact_sum(plan)))
    assert rescued_headers(headers) == [exact.repair.rescued_tokens for _, exact in seen]
    assert any(n.tokens == LATER for n in store._nodes.values()), "what nobody read stays uncounted"

    (info,) = store.sessions()
    path = store.path(info.leaf)
    assert any(n.tokens == LATER and len(n.body) > INLINE_TOKENIZE_BYTES for n in path), "a large node too"
    persisted = [await tokens_in_file(pipeline.store, db, path)] if backend == "sqlite" else []
    assert all(LATER in tokens for tokens in persisted), "stored uncounted"
    detail = orjson.loads(await get(kvwarm, f"/kvwarm/sessions/{info.leaf.hex()}"))
    assert [e["tokens"] for e in detail["elements"]] == [COUNTER.count_body(n.body) for n in path]
    assert [n.tokens for n in store.path(info.leaf)] == [COUNTER.count_body(n.body) for n in path], "kept once counted"
    back = transcript_md.parse(await get(kvwarm, f"/kvwarm/sessions/{info.leaf.hex()}.md"))
    assert [n.tokens for n in back.nodes] == [COUNTER.count_body(n.body) for n in path]
    if backend == "sqlite":
        persisted.append(await tokens_in_file(pipeline.store, db, path))
        assert persisted[1] == [COUNTER.count_body(n.body) for n in path], "the fill is persisted"


async def test_a_shared_store_has_every_node_counted_when_written(
    make_proxy: ProxyFactory, sim: TestServer, redis: RedisServer
) -> None:
    kvwarm = await make_proxy(sim, store__backend=redis.url, store__redis_prefix=f"t{uuid.uuid4().hex[:12]}")
    pipeline = kvwarm.app[PIPELINE]
    store = pipeline.store
    assert isinstance(store, RedisStore)
    planned = plans_seen(pipeline)
    threads = counting_threads(pipeline)
    headers: list[dict[str, str]] = []
    post = poster(kvwarm)

    async def checked(body: dict[str, Any]) -> dict[str, Any]:
        response = await post(body)
        headers.append(response["_headers"])
        return response

    await Agent(post=checked, drift=args_python_dumps).run(4)
    (info,) = await store.sessions()
    path = await store.path(info.leaf)
    assert [n.tokens for n in path] == [COUNTER.count_body(n.body) for n in path]
    assert threads and threading.get_ident() not in threads, "the large system prompt, in a worker thread"
    repaired = [p for p in planned if p.repair.repairs]
    assert len(repaired) >= 2
    assert rescued_headers(headers) == [p.repair.rescued_tokens for p in repaired] == [exact_sum(p) for p in repaired]


async def tokens_in_file(store: LocalStore, db: Path, path: list[Any]) -> list[int]:
    """The token counts the sqlite file holds for ``path``, once the store has flushed."""
    await store.flush()
    with closing(sqlite3.connect(db)) as conn:
        rows = dict(conn.execute("SELECT key, tokens FROM nodes").fetchall())
    return [rows[n.key] for n in path]


def drifted(body: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    """The next turn, re-sending the call with its arguments re-serialized: a repair over it."""
    call = reply["tool_calls"][0]
    spaced = orjson.dumps(orjson.loads(call["function"]["arguments"]), option=orjson.OPT_INDENT_2).decode()
    again = {**reply, "tool_calls": [{**call, "function": {**call["function"], "arguments": spaced}}]}
    return {**body, "messages": [*body["messages"], again, {"role": "tool", "tool_call_id": "call_1", "content": "found"}]}


@pytest.mark.parametrize("query_bytes", [20, 2 * INLINE_TOKENIZE_BYTES], ids=["small, on the loop", "large, in a thread"])
async def test_a_repair_planned_over_uncounted_nodes_counts_them_exactly(
    make_proxy: ProxyFactory, sim: TestServer, query_bytes: int
) -> None:
    kvwarm = await make_proxy(sim)
    pipeline = kvwarm.app[PIPELINE]
    store = pipeline.store
    assert isinstance(store, LocalStore) and store.fills_tokens
    threads = counting_threads(pipeline)
    root = pipeline.tenants.of({"Authorization": "Bearer sk-alice"})
    body, reply = first_turn("cache key " * (query_bytes // 10))
    written_uncounted(store, body, reply, root)
    view = store.view(root)
    repaired = plan_turn(drifted(body, reply), root, view, pipeline.policy)
    assert repaired.repair.repairs and uncounted_in(repaired), "planned over uncounted nodes"
    exact = await pipeline.tokens.exact_rescue(repaired, view)
    assert exact == replace(repaired, repair=replace(repaired.repair, rescued_tokens=exact_sum(repaired)))
    assert exact.repair.rescued_tokens > 0
    on_loop = threading.get_ident()
    assert threads and all((t == on_loop) is (query_bytes < INLINE_TOKENIZE_BYTES) for t in threads)
    filled = [view.get(n.key) for n in rescued_nodes(repaired)]
    assert all(n is not None and n.tokens == COUNTER.count_body(n.body) for n in filled), "filled in"
    before = len(threads)
    assert await pipeline.tokens.exact_rescue(repaired, view) == exact
    assert len(threads) == before, "counted once"



class Wrapped:
    """A store of its own class (as a caching or metered wrapper would be) over a local store,
    answering every call with the local store's."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_the_store_says_how_its_nodes_are_counted_not_its_class(make_proxy: ProxyFactory, sim: TestServer) -> None:
    memory = MemoryStore(3600, 1 << 30)
    kvwarm = await make_proxy(sim, store=Wrapped(LocalStore(memory)))
    pipeline = kvwarm.app[PIPELINE]
    assert not isinstance(pipeline.store, LocalStore)
    seen = rescues_seen(pipeline)
    await Agent(post=poster(kvwarm), drift=args_python_dumps).run(4)
    assert any(n.tokens == LATER for n in memory._nodes.values()), "written uncounted, as the local store keeps them"
    assert seen and all(exact.repair.rescued_tokens == exact_sum(plan) for plan, exact in seen)
    (info,) = memory.sessions()
    detail = orjson.loads(await get(kvwarm, f"/kvwarm/sessions/{info.leaf.hex()}"))
    path = memory.path(info.leaf)
    assert [e["tokens"] for e in detail["elements"]] == [COUNTER.count_body(n.body) for n in path]
