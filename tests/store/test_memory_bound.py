"""The byte budget bounds what the process holds: the store's accounting, eviction on insert, the identity memo.

``StoreStats.bytes`` must be what the store really holds (checked against a full recount
and against tracemalloc), and must stay within ``max_bytes`` after every insert and every
session update, however fast new sessions arrive; the identity memo likewise within its
``max_bytes``.
"""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import orjson
import pytest

from proxy.core.identity import IdentityMemo, identify_messages
from proxy.core.policy import Policy
from proxy.store.base import Node, SessionTotals
from proxy.store.memory.store import (
    IDENTITY_ENTRY,
    INDEX_ENTRY,
    LEAF_ENTRY,
    MemoryStore,
    blob_cost,
    blob_hash,
    list_cost,
    node_cost,
    session_cost,
)
from proxy.store.sqlite.store import SqliteStore

from .conftest import build_path, tenant_root


def recount(store: MemoryStore) -> int:
    """The store's bytes counted from scratch; also checks that the leaf index is exact."""
    leaves = {k for k in store._nodes if k not in store._children}
    assert set(store._leaves) == leaves, "the LRU of leaves is not exactly the childless nodes"
    total = sum(node_cost(n) for n in store._nodes.values()) + LEAF_ENTRY * len(leaves)
    for entry in store._children.values():
        total += INDEX_ENTRY + (list_cost(len(entry)) if isinstance(entry, list) else 0)
    for entry in store._by_identity.values():
        total += IDENTITY_ENTRY + (list_cost(len(entry)) if isinstance(entry, list) else 0)
    total += INDEX_ENTRY * len(store._tenants)
    total += sum(blob_cost(len(b.data)) for b in store._blobs.values())
    total += sum(session_cost(t) for t in store._totals.values())
    return total


def assert_consistent(store: MemoryStore) -> None:
    assert store.stats().bytes == recount(store)
    for key in store._nodes:
        path = store.path(key)
        assert path and path[-1].key == key, "a stored node lost an ancestor"
    assert all(leaf in store._nodes for leaf in store._totals), "totals outlived their leaf"
    for entry in (*store._children.values(), *store._by_identity.values()):
        for node in entry if isinstance(entry, list) else (entry,):
            assert store._nodes.get(node.key) is node, "an index lists an evicted node"


def turn(i: int, shared_tenant: bool) -> tuple[list[Node], SessionTotals]:
    """A new session's first turn, as the pipeline stores it: tools, system, user, assistant."""
    root = tenant_root("one" if shared_tenant else f"t{i}")
    path = build_path(
        root,
        [("system", "You are a careful coding agent. Keep changes small."), f"Session {i}: where is key_{i} computed?",
         ("assistant", f"In module m{i}.py, by key_{i}; it hashes the prefix.")],
        tools=orjson.dumps([{"type": "function", "function": {"name": "read_file"}}]),
    )
    totals = SessionTotals(turns=1, prompt_tokens=1000 + i, completion_tokens=300 + i, cost_usd=0.01, model=f"model-{i % 7}")
    return path, totals


@pytest.mark.parametrize("shared_tenant", [False, True], ids=["tenant-each", "one-tenant"])
def test_a_flood_of_new_sessions_never_exceeds_the_budget(shared_tenant, clock):
    budget = 150_000
    store = MemoryStore(3600, budget, clock=clock)
    peak = 0
    for i in range(2_000):
        path, totals = turn(i, shared_tenant)
        store.insert(path)
        peak = max(peak, store.stats().bytes)
        assert store.stats().bytes <= budget, f"over budget after insert {i}"
        store.add_turn(path[-1].key, None, totals)
        assert store.stats().bytes <= budget, f"over budget after add_turn {i}"
        clock.advance(0.01)
    stats = store.stats()
    assert stats.evicted > 1_000
    assert peak > budget * 0.9, "the store should fill its budget, not empty itself"
    # The newest session survives whole, with its totals.
    assert store.path(path[-1].key) == [store.get(n.key) for n in path]
    assert store.totals(path[-1].key) is not None
    assert_consistent(store)


def test_accounting_matches_a_recount_through_forks_touches_moves_and_evictions(clock):
    rng = random.Random(11)
    store = MemoryStore(120, 10**12, clock=clock)
    tenants = [tenant_root(f"t{i}") for i in range(4)]
    paths: list[list[Node]] = []
    for step in range(1_500):
        clock.advance(rng.random())
        kind = rng.random()
        if kind < 0.55 or not paths:
            tenant = rng.choice(tenants)
            msgs = [("system", f"s{rng.randint(0, 2)}")] + [f"u{rng.randint(0, 3)}" for _ in range(rng.randint(0, 4))]
            msgs.append(("assistant", "x" * rng.randint(0, 600) + str(step)))
            path = build_path(tenant, msgs)
            store.insert(path)
            previous = next((n.key for n in reversed(path[:-1]) if store.totals(n.key) is not None), None)
            store.add_turn(path[-1].key, previous, SessionTotals(prompt_tokens=rng.randint(0, 10**6), model=rng.choice(["", "m", "gpt-x"])))
            paths.append(path)
        elif kind < 0.8:
            store.touch([n.key for n in rng.choice(paths)], clock.now)
        elif kind < 0.9:
            store._max_bytes = int(store.stats().bytes * rng.uniform(0.3, 0.95))
            store.insert(build_path(rng.choice(tenants), [f"trigger {step}"]))
            assert store.stats().bytes <= store._max_bytes
            store._max_bytes = 10**12
        else:
            store.evict(clock.now)
        if step % 50 == 0:
            assert_consistent(store)
    assert_consistent(store)
    assert store.stats().evicted > 100


def test_parents_outlive_their_children(clock):
    drops: list[bytes] = []

    class Watched(MemoryStore):
        def _on_drop(self, key: bytes, freed_blob: bytes | None) -> None:
            # Index lists are rebuilt after a run: "stored children" are those still in _nodes.
            alive = [c.key for c in self.children(key) if c.key in self._nodes]
            assert not alive, "a parent was evicted before its children"
            drops.append(key)

    rng = random.Random(5)
    store = Watched(3600, 60_000, clock=clock)
    for i in range(1_500):
        msgs = [("system", f"s{rng.randint(0, 3)}")] + [f"u{rng.randint(0, 5)}" for _ in range(rng.randint(0, 6))]
        store.insert(build_path(tenant_root(f"t{rng.randint(0, 2)}"), [*msgs, f"x{i}"]))
        clock.advance(1)
    assert len(drops) > 1_000
    assert_consistent(store)


def test_evicted_sessions_drop_their_totals_and_their_bytes(clock):
    ended: set[bytes] = set()

    class Watched(MemoryStore):
        def _on_totals(self, leaf: bytes, totals: SessionTotals | None) -> None:
            if totals is None:
                ended.add(leaf)

    budget = 100_000
    store = Watched(3600, budget, clock=clock)
    leaves = []
    for i in range(600):
        path, totals = turn(i, shared_tenant=True)
        store.insert(path)
        store.add_turn(path[-1].key, None, totals)
        leaves.append(path[-1].key)
        clock.advance(1)
    kept = {s.leaf for s in store.sessions()}
    assert kept and len(kept) < len(leaves)
    assert kept == {leaf for leaf in leaves if store.get(leaf) is not None}
    assert ended == set(leaves) - kept
    assert store.stats().sessions == len(kept)
    assert_consistent(store)
    # Everything goes once nothing is used: no bytes are left behind.
    store.evict(clock.advance(7200))
    assert store.stats().nodes == 0 and store.stats().bytes == 0 and store.sessions() == []


@contextmanager
def traced() -> Iterator[Callable[[], int]]:
    """Bytes allocated (and still held) since entering, as tracemalloc sees them."""
    gc.collect()
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    try:
        yield lambda: tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("budget", [10**12, 400_000], ids=["filling", "churning"])
def test_accounted_bytes_track_traced_memory(budget, clock):
    """Accounted within 1x-2x of what tracemalloc sees: an upper bound on Python's allocations
    (tracemalloc does not see pymalloc's 16-byte rounding, which the accounting includes),
    never an undercount. Nodes are built inside the trace, as the pipeline builds them."""
    with traced() as held:
        store = MemoryStore(3600, budget, clock=clock)
        for i in range(3_000):
            path, totals = turn(i, shared_tenant=i % 2 == 0)
            store.insert(path)
            store.add_turn(path[-1].key, None, totals)
            clock.advance(0.01)
        del path, totals
        gc.collect()
        real = held()
    accounted = store.stats().bytes
    assert real <= accounted <= 2 * real, (real, accounted, store.stats())


async def test_a_loaded_sqlite_store_is_accounted_ordered_and_bounded(tmp_path, clock):
    store = SqliteStore(tmp_path / "kv.db", 3600, 10**12, secret=b"k" * 32, flush_interval=3600, clock=clock)
    await store.open()
    for i in range(60):
        path, totals = turn(i, shared_tenant=True)
        store.insert(path)
        store.add_turn(path[-1].key, None, totals)
        clock.advance(1)
    first, _ = turn(0, shared_tenant=True)
    store.touch([n.key for n in first], clock.advance(1))  # session 0 is now the newest
    before = store.stats()
    await store.close()

    budget = before.bytes // 2
    again = SqliteStore(tmp_path / "kv.db", 3600, budget, secret=b"k" * 32, flush_interval=3600, clock=clock)
    await again.open()
    try:
        assert again.stats() == before  # loaded over budget: counted exactly, nothing evicted yet
        assert_consistent(again)
        again.insert(turn(1000, shared_tenant=True)[0])
        assert again.stats().bytes <= budget
        assert again.get(first[-1].key) is not None, "the touched session went before older ones"
        assert again.get(turn(1, shared_tenant=True)[0][-1].key) is None
        assert_consistent(again)
    finally:
        await again.close()


# -- the identity memo ----------------------------------------------------------------------


def _messages(batch: int, n: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"message {batch}-{i}: a short one"} for i in range(n)]


def test_identity_memo_holds_what_it_accounts_and_stays_within_budget():
    budget = 2 * 1024 * 1024
    memo = IdentityMemo(max_bytes=budget)
    policy = Policy()
    with traced() as held:
        for batch in range(12):
            msgs = _messages(batch, 2_000)
            identify_messages(msgs, policy, memo)
            assert memo._size <= budget
        del msgs
        gc.collect()
        real = held()
    assert len(memo) > 5_000, "the memo should fill its budget"
    # Keys are tight copies: orjson's own output would hold >= 4 kB per short message.
    assert real <= memo._size <= 2 * real, (real, memo._size, len(memo))
    # The newest messages are remembered, exactly.
    last = _messages(11, 2_000)
    assert all(memo.get(orjson.dumps(m)) is not None for m in last[-100:])
    assert identify_messages(last, policy, memo) == identify_messages(last, policy)


def test_identity_memo_bounds_tool_sets_by_bytes():
    budget = 1024 * 1024
    memo = IdentityMemo(max_bytes=budget)
    big = "d" * 20_000
    for i in range(200):
        tools = [{"type": "function", "function": {"name": f"f{i}", "description": big}}]
        memo.tools_identity(tools)
        assert memo._size <= budget
        assert memo._tools_size <= budget // 16
    assert 0 < len(memo._tools) < 200
    assert memo._size == memo._tools_size  # no messages: the budget holds only tool sets


def test_identity_memo_rejects_a_non_positive_budget():
    with pytest.raises(ValueError):
        IdentityMemo(max_bytes=0)


def test_a_turns_new_nodes_are_kept_as_they_are_and_accounted(clock):
    """``write_turn_now`` keeps a turn's new nodes themselves (their bodies are tight copies,
    their parent key and tenant the stored objects): no copy, no rebuilt node. A plain
    ``insert`` still keeps a tight copy of what it is given. Either way the accounting holds."""
    from proxy.core.identity import IdentityMemo as Memo
    from proxy.core.plan import plan_turn, turn_write
    from proxy.core.record import Reply
    from proxy.store.local import LocalStore

    memory = MemoryStore(3600, 1 << 30, clock=clock)
    store = LocalStore(memory)
    root = tenant_root("t")
    memo, policy = Memo(), Policy()
    messages: list[dict[str, object]] = [{"role": "system", "content": "You help."}]
    for turn_no in range(4):
        messages.append({"role": "user", "content": f"question {turn_no}"})
        body = {"model": "m", "messages": [dict(m) for m in messages]}
        plan = plan_turn(body, root, store.view(root), policy, memo)
        reply = {"role": "assistant", "content": f"answer {turn_no}"}
        turn = turn_write(plan, Reply(message=reply, finish_reason="stop", partial=False, model="m"), None, None, model="m", client_gone=False, now=1.0, memo=memo)
        assert turn is not None and turn.nodes
        store.write_turn_now(turn)
        for node in turn.nodes:
            assert memory._nodes[node.key] is node, "a turn's new node was rebuilt"
            assert memory._blobs[blob_hash(node.body)].data is node.body
        messages.append(reply)
        assert_consistent(memory)
    # A node given to insert() (a body that may hold a writer's buffer) is copied as before.
    data = orjson.dumps({"role": "user", "content": "x" * 100})
    leaf = memory.path(turn.leaf)[-1]
    other = Node(
        key=b"k" * 16, parent=leaf.key, tenant=leaf.tenant, depth=leaf.depth + 1, role="user",
        identity=b"i" * 16, body=data, tokens=1, created=1.0,
    )
    assert memory.insert([other]) == 1
    assert memory._nodes[other.key].body == data and memory._nodes[other.key].body is not data
    assert_consistent(memory)
