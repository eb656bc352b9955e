"""MemoryStore: the index, insert-if-absent, eviction, blob interning and session totals."""

from __future__ import annotations

import asyncio
import gc
import random
import tracemalloc
from dataclasses import replace

import pytest

from proxy.config import StoreSettings
from proxy.errors import ConfigError
from proxy.store.base import SessionTotals, TranscriptStore
from proxy.store.factory import make_store
from proxy.store.local import LocalStore
from proxy.store.memory.store import MemoryStore, blob_cost, node_cost

from .conftest import FakeClock

BIG = 10**12


def assert_tree_closed(store: MemoryStore) -> None:
    """Every stored node's ancestors are stored: eviction never orphans a node."""
    for key in list(store._nodes):
        path = store.path(key)
        assert path and path[-1].key == key


def test_is_a_transcript_store() -> None:
    assert isinstance(MemoryStore(60, BIG), TranscriptStore)


def test_insert_get_children_by_identity_path(tenant, make_path):
    store = MemoryStore(60, BIG)
    a = make_path(tenant, [("system", "be brief"), "hi", ("assistant", "hello")])
    b = make_path(tenant, [("system", "be brief"), "bye"])
    assert store.insert(a) == 4
    assert store.insert(b) == 1  # shares tools + system with a

    assert store.get(a[2].key) == a[2]
    assert store.get(b"x" * 16) is None
    assert store.path(a[-1].key) == a
    assert store.path(b[-1].key) == b
    assert [n.key for n in store.children(tenant)] == [a[0].key]
    assert [n.key for n in store.children(a[1].key)] == [a[2].key, b[2].key]  # oldest first
    assert store.children(a[-1].key) == ()
    assert [n.key for n in store.by_identity(tenant, a[2].identity)] == [a[2].key]
    assert store.by_identity(b"other-tenant-000", a[2].identity) == ()
    assert store.path(b"missing") == []
    assert store.stats().nodes == 5


def test_by_identity_lists_every_position(tenant, make_path):
    store = MemoryStore(60, BIG)
    one = make_path(tenant, ["go", "go"])
    store.insert(one)
    assert {n.depth for n in store.by_identity(tenant, one[1].identity)} == {1, 2}


def test_tenants_never_share_nodes(make_path, make_tenant):
    store = MemoryStore(60, BIG)
    alice, bob = make_tenant("alice"), make_tenant("bob")
    pa, pb = make_path(alice, ["same text"]), make_path(bob, ["same text"])
    store.insert(pa)
    store.insert(pb)
    assert pa[-1].key != pb[-1].key
    assert [n.tenant for n in store.by_identity(alice, pa[-1].identity)] == [alice]
    assert store.path(pb[-1].key)[0].tenant == bob


def test_first_insert_wins(tenant, make_path):
    store = MemoryStore(60, BIG)
    first = make_path(tenant, ["hi"])
    # Same key (same chain), different canonical body: a second writer must not clobber.
    second = [first[0], replace(first[1], body=b'{"role":"user","content":" hi "}')]
    assert store.insert(first) == 2
    assert store.insert(second) == 0
    assert store.get(first[1].key).body == first[1].body
    assert store.stats().nodes == 2


async def test_concurrent_inserts_converge(tenant, make_path):
    store = MemoryStore(60, BIG)
    rng = random.Random(7)
    # 50 writers over overlapping paths: shared heads, forks, some paths written twice.
    paths = [make_path(tenant, [("system", "sys")] + [f"m{j}" for j in range(rng.randint(1, 6))] + [f"w{i % 20}"]) for i in range(50)]

    async def writer(path):
        for start in range(0, len(path), 2):
            store.insert(path[: start + 2])
            await asyncio.sleep(0)

    await asyncio.gather(*(writer(p) for p in paths))
    expected = {n.key: n for p in paths for n in p}
    assert store.stats().nodes == len(expected)
    for p in paths:
        assert store.path(p[-1].key) == p
    for key, node in expected.items():
        assert store.get(key) == node
        assert node in store.children(node.parent)
    for parent in {n.parent for n in expected.values()}:
        kids = store.children(parent)
        assert len({n.key for n in kids}) == len(kids)  # no duplicate child entries


def test_orphans_are_skipped(tenant, make_path, make_tenant, chain_hash):
    store = MemoryStore(60, BIG)
    path = make_path(tenant, ["a", "b"])
    assert store.insert([path[2]]) == 0  # parent absent
    assert store.insert([path[1], path[0]]) == 1  # child before parent: child skipped
    assert store.get(path[1].key) is None
    assert store.insert(path) == 2  # parents earlier in the batch are fine
    # Element 0 must hang from its tenant root.
    bad_root = replace(path[0], tenant=make_tenant("eve"), key=chain_hash(b"r" * 16, path[0].identity))
    assert store.insert([bad_root]) == 0
    # A child claiming another tenant, or the wrong depth, is not attached.
    foreign = replace(path[2], tenant=make_tenant("eve"), key=chain_hash(path[2].key, b"f" * 16), parent=path[2].key, depth=3)
    skipped_depth = replace(path[2], key=chain_hash(path[2].key, b"g" * 16), parent=path[2].key, depth=5)
    assert store.insert([foreign, skipped_depth]) == 0
    assert store.stats().nodes == 3


def test_ttl_eviction(tenant, make_path, clock):
    store = MemoryStore(60, BIG, clock=clock)
    old = make_path(tenant, ["old"])
    store.insert(old)
    clock.advance(40)
    new = make_path(tenant, ["new"])
    store.insert(new)  # shares element 0 with old, used now
    clock.advance(30)  # old's message unused for 70 s, new's for 30 s
    assert store.evict(clock.now) == 1
    assert store.get(old[1].key) is None
    assert store.path(new[-1].key) == new
    assert store.stats().evicted == 1
    assert store.evict(clock.now + 60) == 2
    assert store.stats().nodes == 0
    assert store.children(tenant) == ()


def test_ttl_counts_from_last_use(tenant, make_path, clock):
    store = MemoryStore(60, BIG, clock=clock)
    path = make_path(tenant, ["a", "b"])
    store.insert(path)
    store.touch([n.key for n in path], clock.advance(50))
    assert store.evict(clock.advance(50)) == 0
    assert store.evict(clock.advance(11)) == 3


def test_ttl_never_takes_a_parent_before_its_children(tenant, make_path, clock):
    store = MemoryStore(60, BIG, clock=clock)
    path = make_path(tenant, ["a", "b", "c"])
    store.insert(path)
    store.touch([path[-1].key], clock.advance(100))  # only the leaf was used lately
    assert store.evict(clock.now) == 0
    assert store.path(path[-1].key) == path
    assert store.evict(clock.now + 61) == 4  # then the whole chain goes, leaf first


def test_byte_budget_evicts_lru_leaves_first(tenant, make_path, clock):
    store = MemoryStore(3600, BIG, clock=clock)
    shared = [("system", "s")]
    a = make_path(tenant, [*shared, "a1", "a2"])
    b = make_path(tenant, [*shared, "b1", "b2"])
    store.insert(a)
    clock.advance(1)
    store.insert(b)
    clock.advance(1)
    store.touch([n.key for n in a], clock.now)  # a is now the most recently used path
    # 6 nodes stored (tools, system, a1, a2, b1, b2) are at budget: nothing to do.
    store._max_bytes = store.stats().bytes
    assert store.evict(clock.now) == 0
    store._max_bytes -= 1
    # Over by one byte: the least recently used leaf is b2 (b1 is older but not a leaf).
    assert store.evict(clock.now) == 1
    assert store.get(b[-1].key) is None and store.get(b[-2].key) is not None
    assert_tree_closed(store)
    # Squeeze to what tools and system alone take: b1 (now the LRU leaf), then a2, then a1 go.
    alone = MemoryStore(3600, BIG, clock=clock)
    alone.insert(a[:2])
    store._max_bytes = alone.stats().bytes
    assert store.evict(clock.now) == 3
    assert [n.key for n in store.path(a[1].key)] == [a[0].key, a[1].key]
    assert store.stats().nodes == 2
    assert store.stats().bytes == alone.stats().bytes
    assert_tree_closed(store)


def test_byte_budget_random_tree_stays_closed(tenant, make_path, clock):
    store = MemoryStore(3600, BIG, clock=clock)
    rng = random.Random(3)
    paths = []
    for i in range(200):
        msgs = [("system", f"s{rng.randint(0, 3)}")] + [f"u{rng.randint(0, 4)}" for _ in range(rng.randint(0, 5))] + [f"x{i}"]
        paths.append(make_path(tenant, msgs))
        store.insert(paths[-1])
        store.touch([n.key for n in rng.choice(paths)], clock.advance(1))
    full = store.stats().bytes
    for fraction in (0.8, 0.5, 0.2, 0.05):
        store._max_bytes = int(full * fraction)
        store.evict(clock.now)
        assert store.stats().bytes <= store._max_bytes
        assert_tree_closed(store)
    assert store.stats().evicted > 0


def test_eviction_drops_totals(tenant, make_path, clock):
    store = MemoryStore(60, BIG, clock=clock)
    path = make_path(tenant, ["hi"])
    store.insert(path)
    store.add_turn(path[-1].key, None, SessionTotals(prompt_tokens=10))
    assert store.stats().sessions == 1
    store.evict(clock.advance(61))
    assert store.totals(path[-1].key) is None
    assert store.sessions() == []


def test_blobs_are_interned(make_path, make_tenant):
    sessions = 10_000
    stores = {}
    for size in (1, 20_000):
        store = stores[size] = MemoryStore(3600, BIG)
        system = ("system", "S" * size)
        for i in range(sessions):
            store.insert(make_path(make_tenant(f"t{i}"), [system, f"question {i}"]))
    stats = stores[20_000].stats()
    assert stats.nodes == 3 * sessions
    # Distinct blobs: "[]", the system body, one per question.
    assert stats.blobs == 2 + sessions
    # The long system prompt is counted once, not once per session.
    big, small = (stores[n]._nodes for n in (20_000, 1))
    grown = stats.bytes - stores[1].stats().bytes
    long_node = next(n for n in big.values() if n.role == "system")
    short_node = next(n for n in small.values() if n.role == "system")
    # (A node's token count above 256 is an int object of its own: counted per node.)
    per_node = node_cost(long_node) - node_cost(short_node)
    assert grown == blob_cost(len(long_node.body)) - blob_cost(len(short_node.body)) + sessions * per_node
    systems = {id(n.body) for n in big.values() if n.role == "system"}
    assert len(systems) == 1


def test_node_overhead_estimate_is_honest(make_path, make_tenant):
    """stats().bytes is what the byte budget and the benchmark see: it must not hide real memory."""
    tenants = [make_tenant(f"t{i}") for i in range(5_000)]
    gc.collect()
    tracemalloc.start()
    try:
        store = MemoryStore(3600, BIG)
        for i, tenant in enumerate(tenants):
            # Bodies come from orjson, as in the pipeline (its output over-allocates).
            store.insert(make_path(tenant, [("system", "S" * 2_000), f"q {i}", ("assistant", f"a {i}")]))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    stats = store.stats()
    assert held <= stats.bytes * 1.25, (held / stats.nodes, stats.bytes / stats.nodes)


def test_blob_bytes_released_with_last_reference(make_path, make_tenant, clock):
    store = MemoryStore(60, BIG, clock=clock)
    big = ("system", "B" * 5_000)
    store.insert(make_path(make_tenant("a"), [big]))
    clock.advance(50)
    keep = make_path(make_tenant("b"), [big])
    store.insert(keep)
    store.evict(clock.advance(20))  # tenant a's nodes expire; the blob is still used by b
    assert store.stats().nodes == 2
    assert store.get(keep[1].key).body == keep[1].body
    assert store.stats().bytes >= 5_000
    store.evict(clock.advance(100))
    assert store.stats().bytes == 0 and store.stats().blobs == 0


def test_session_totals_move_to_the_new_leaf(tenant, make_path, clock):
    store = MemoryStore(60, BIG, clock=clock)
    turn1 = make_path(tenant, ["hi", ("assistant", "hello")])
    store.insert(turn1)
    t = store.add_turn(turn1[-1].key, turn1[0].key, SessionTotals(prompt_tokens=100, cached_tokens=0, completion_tokens=5, cost_usd=0.5, model="m1"))
    assert (t.turns, t.prompt_tokens, t.created) == (1, 100, clock.now)

    clock.advance(10)
    turn2 = make_path(tenant, ["hi", ("assistant", "hello"), "more", ("assistant", "sure")])
    store.insert(turn2)
    t = store.add_turn(turn2[-1].key, turn1[-1].key, SessionTotals(prompt_tokens=120, cached_tokens=100, completion_tokens=3, unknown_cache_turns=0, cost_usd=0.25, billed=True, repaired=2, last_break="content_changed"))
    assert store.totals(turn1[-1].key) is None
    assert t == store.totals(turn2[-1].key)
    assert (t.turns, t.prompt_tokens, t.cached_tokens, t.completion_tokens) == (2, 220, 100, 8)
    assert (t.cost_usd, t.billed, t.repaired, t.last_break, t.model) == (0.75, True, 2, "content_changed", "m1")
    assert (t.created, t.updated) == (1000.0, 1010.0)
    assert [s.leaf for s in store.sessions()] == [turn2[-1].key]
    assert store.sessions()[0].depth == 4


def test_retry_of_same_leaf_adds_a_turn(tenant, make_path):
    store = MemoryStore(60, BIG)
    path = make_path(tenant, ["hi"])
    store.insert(path)
    store.add_turn(path[-1].key, path[-1].key, SessionTotals(prompt_tokens=1))
    t = store.add_turn(path[-1].key, path[-1].key, SessionTotals(prompt_tokens=1))
    assert (t.turns, t.prompt_tokens) == (2, 2)


def test_returned_totals_are_copies(tenant, make_path):
    store = MemoryStore(60, BIG)
    path = make_path(tenant, ["hi"])
    store.insert(path)
    t = store.add_turn(path[-1].key, None, SessionTotals(prompt_tokens=1))
    t.prompt_tokens = 999
    store.totals(path[-1].key).prompt_tokens = 999
    store.sessions()[0].totals.prompt_tokens = 999
    assert store.totals(path[-1].key).prompt_tokens == 1


def test_add_turn_on_unstored_leaf_keeps_nothing(tenant, make_path):
    store = MemoryStore(60, BIG)
    path = make_path(tenant, ["hi", "there"])
    store.insert(path[:2])
    store.add_turn(path[1].key, None, SessionTotals(prompt_tokens=5))
    t = store.add_turn(path[2].key, path[1].key, SessionTotals(prompt_tokens=1))
    assert t.prompt_tokens == 6
    assert store.totals(path[1].key).prompt_tokens == 5  # not moved to a leaf that is not stored
    assert store.totals(path[2].key) is None


def test_sessions_most_recent_first_and_by_tenant(make_path, make_tenant, clock):
    store = MemoryStore(60, BIG, clock=clock)
    leaves = []
    for name in ("a", "b", "a"):
        path = make_path(make_tenant(name), [f"hello {len(leaves)}"])
        store.insert(path)
        store.add_turn(path[-1].key, None, SessionTotals())
        leaves.append(path[-1].key)
        clock.advance(1)
    assert [s.leaf for s in store.sessions()] == leaves[::-1]
    assert [s.leaf for s in store.sessions(make_tenant("a"))] == [leaves[2], leaves[0]]
    store.add_turn(leaves[0], None, SessionTotals())
    assert store.sessions()[0].leaf == leaves[0]


def test_secret(tenant):
    assert MemoryStore(60, BIG, secret=b"k" * 32).secret() == b"k" * 32
    one, two = MemoryStore(60, BIG), MemoryStore(60, BIG)
    assert len(one.secret()) == 32 and one.secret() == one.secret()
    assert one.secret() != two.secret()


async def test_lifecycle_is_a_no_op():
    store = MemoryStore(60, BIG)
    await store.open()
    await store.flush()
    await store.close()


def _settings(backend, secret=""):
    return StoreSettings(backend=backend, ttl_seconds=60, max_bytes=BIG, secret=secret, flush_interval=1)


def test_factory_memory():
    store = make_store(_settings("memory", "abc"))
    assert isinstance(store, LocalStore) and isinstance(store.local, MemoryStore)
    assert store.secret() == b"abc"
    assert len(make_store(_settings("memory")).secret()) == 32


@pytest.mark.parametrize("backend", ["mysql://x", "redis:x", "sqlite:", "", "Memory"])
def test_factory_rejects_unknown_backends(backend):
    with pytest.raises(ConfigError) as info:
        make_store(_settings(backend))
    assert info.value.key == "store.backend"


@pytest.mark.parametrize("seed", range(6))
def test_touching_the_deepest_node_evicts_as_touching_the_whole_path(tenant, make_path, seed):
    """A request touches only its path's deepest node (O(1), not O(messages)): the store evicts
    exactly what it would have evicted had every node of every path been touched, by TTL and
    by budget, and keeps the same last use for every leaf."""
    rng = random.Random(seed)
    whole_clock, deep_clock = FakeClock(), FakeClock()
    whole = MemoryStore(120, BIG, clock=whole_clock)
    deep = MemoryStore(120, BIG, clock=deep_clock)
    paths: list[list] = []
    for step in range(400):
        pause = rng.choice((0.5, 1, 3))
        whole_clock.advance(pause)
        deep_clock.advance(pause)
        if not paths or rng.random() < 0.4:
            msgs = [("system", f"s{rng.randint(0, 2)}")] + [f"u{rng.randint(0, 3)}" for _ in range(rng.randint(0, 4))] + [f"x{step}"]
            paths.append(make_path(tenant, msgs))
            whole.insert(paths[-1])
            deep.insert(paths[-1])
        else:
            # A request re-sends some stored prefix: the whole path vs its deepest node.
            path = rng.choice(paths)
            path = path[: rng.randint(1, len(path))]
            keys = [n.key for n in path if whole.get(n.key) is not None]
            keys = keys[: next((i for i, n in enumerate(path) if whole.get(n.key) is None), len(path))]
            whole.touch(keys, whole_clock.now)
            deep.touch(keys[-1:], deep_clock.now)
        roll = rng.random()
        if roll < 0.1:
            assert whole.evict(whole_clock.now) == deep.evict(deep_clock.now)
        elif roll < 0.15:
            budget = int(whole.stats().bytes * rng.uniform(0.5, 0.95))
            whole._max_bytes = deep._max_bytes = budget
            assert whole.evict(whole_clock.now) == deep.evict(deep_clock.now)
            whole._max_bytes = deep._max_bytes = BIG
        assert set(whole._nodes) == set(deep._nodes)
        assert list(whole._leaves) == list(deep._leaves)
        assert {k: whole._used[k] for k in whole._leaves} == {k: deep._used[k] for k in deep._leaves}
    assert whole.stats().evicted > 50  # both triggers were exercised


def test_last_session_is_the_deepest_leaf_on_the_path_that_holds_totals(tenant, make_path):
    store = MemoryStore(3600, BIG)
    path = make_path(tenant, [("system", "s"), "a", ("assistant", "b"), "c", ("assistant", "d")])
    store.insert(path)
    keys = [n.key for n in path]
    assert store.last_session([]) is None
    assert store.last_session(keys) is None  # no totals anywhere on the path
    store.add_turn(keys[2], None, SessionTotals(turns=1))
    assert store.last_session(keys) == keys[2]  # in the middle
    assert store.last_session(keys[:2]) is None  # above it
    store.add_turn(keys[4], None, SessionTotals(turns=1))
    assert store.last_session(keys) == keys[4]  # the deepest one, at the end
    assert store.last_session(keys[:4]) == keys[2]
