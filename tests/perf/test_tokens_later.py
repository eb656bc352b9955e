"""Token counts of a turn's small nodes are filled in after the response; the nodes are not.

With the memory store, a turn's nodes are written before the response's last byte, uncounted,
and their counts (tiktoken) are filled in at the end of that event-loop iteration, in a batch
with every other request answered meanwhile. Checked here:

* the store's fill replaces the node everywhere it is indexed, and its byte accounting is what
  a store built with the counted nodes holds;
* end to end (kvwarm, the reference upstream, a drifting agent): after every response every
  stored node has its exact count, and ``rescued=`` in the header is the exact sum of the
  counts of the nodes it names;
* a repair planned while the nodes it rescues are still uncounted (same loop iteration) still
  reports the exact count.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from aiohttp.test_utils import TestServer

from proxy.app import PIPELINE
from proxy.core.match import tenant_root
from proxy.core.plan import plan_turn, turn_write
from proxy.core.policy import Policy
from proxy.core.record import Reply
from proxy.pipeline import LATER
from proxy.store.local import LocalStore
from proxy.store.memory import MemoryStore
from proxy.tokens import TokenCounter
from tests.agents import Agent, args_python_dumps
from tests.conftest import ProxyFactory, poster, store_of

SECRET = b"t" * 32
ROOT = tenant_root(SECRET, "Bearer sk-alice")
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def first_turn() -> tuple[dict[str, Any], dict[str, Any]]:
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q":"cache key"}'}}
    body = {"model": "m", "tools": TOOLS, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find it."}]}
    return body, {"role": "assistant", "content": None, "tool_calls": [call]}


def written_uncounted(store: LocalStore, body: dict[str, Any], reply: dict[str, Any]) -> list[Any]:
    plan = plan_turn(body, ROOT, store.view(ROOT), Policy())
    turn = turn_write(plan, Reply(reply, "tool_calls", False, "m"), None, None, model="m", client_gone=False, now=time.time(),
                      count_tokens=lambda body: LATER)
    assert turn is not None
    store.write_turn_now(turn)
    return list(turn.nodes)


def test_a_fill_reaches_every_index_and_the_accounting() -> None:
    counter = TokenCounter()
    store = LocalStore(MemoryStore(3600, 1 << 30, secret=SECRET))
    assert store.fills_tokens
    nodes = written_uncounted(store, *first_turn())
    memory = store.local
    assert isinstance(memory, MemoryStore)
    assert all(memory.get(n.key).tokens == LATER for n in nodes)  # type: ignore[union-attr]
    counts = {n.key: counter.count_body(n.body) for n in nodes}
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
    turn = turn_write(plan, Reply(reply, "tool_calls", False, "m"), None, None, model="m", client_gone=False, now=time.time(),
                      count_tokens=counter.count_body)
    assert turn is not None
    counted.write_turn_now(turn)
    assert counted.stats().bytes == store.stats().bytes


async def test_counts_and_rescued_tokens_are_exact_after_every_response(make_proxy: ProxyFactory, sim: TestServer) -> None:
    kvwarm = await make_proxy(sim)
    counter = TokenCounter()
    store = store_of(kvwarm)
    headers: list[dict[str, str]] = []
    post = poster(kvwarm)

    async def checked(body: dict[str, Any]) -> dict[str, Any]:
        response = await post(body)
        headers.append(response["_headers"])
        for node in store._nodes.values():  # every node, written before the response, counted after it
            assert node.tokens == counter.count_body(node.body), node.role
        return response

    agent = Agent(post=checked, drift=args_python_dumps)
    await agent.run(5)
    rescued = [int(h["x-kvwarm-prefix"].split("rescued=")[1].split(";")[0]) for h in headers if "rescued=" in h["x-kvwarm-prefix"]]
    assert len(rescued) >= 3 and all(r > 0 for r in rescued), "the drifting agent's repairs rescue tokens"


async def test_a_repair_planned_before_the_fill_counts_exactly(make_proxy: ProxyFactory, sim: TestServer) -> None:
    kvwarm = await make_proxy(sim)
    pipeline = kvwarm.app[PIPELINE]
    store = pipeline.store
    assert isinstance(store, LocalStore) and store.fills_tokens
    root = pipeline.tenants.of({"Authorization": "Bearer sk-alice"})
    body, reply = first_turn()
    plan = plan_turn(body, root, store.view(root), pipeline.policy)
    turn = turn_write(plan, Reply(reply, "tool_calls", False, "m"), None, None, model="m", client_gone=False, now=time.time(),
                      count_tokens=lambda b: LATER)
    assert turn is not None
    store.write_turn_now(turn)
    pipeline.count_after(turn)  # queued for the end of this iteration: not counted yet
    # The next turn re-sends the call with its arguments re-serialized: a repair over those nodes.
    drifted = {**body, "messages": [*body["messages"], {**reply, "tool_calls": [{**reply["tool_calls"][0], "function": {"name": "search", "arguments": '{"q": "cache key"}'}}]},
                                    {"role": "tool", "tool_call_id": "call_1", "content": "found"}]}
    view = store.view(root)
    repaired = plan_turn(drifted, root, view, pipeline.policy)
    assert repaired.repair.repairs and repaired.repair.rescued_tokens < 0, "planned over uncounted nodes"
    exact = pipeline.exact_rescue(repaired, view)
    counter = TokenCounter()
    first = min(r.depth for r in repaired.repair.repairs)
    assert repaired.match is not None
    expected = sum(counter.count_body(n.body) for n in repaired.match.nodes[first:])
    assert exact.repair.rescued_tokens == expected > 0
    assert exact == replace(repaired, repair=replace(repaired.repair, rescued_tokens=expected))
