"""RedisStore against real ``redis-server`` processes (standalone and a 3-master cluster).

Contract tests run the same scenarios on ``LocalStore(MemoryStore)`` and ``RedisStore``
and expect the same answers; the rest is what only a shared store has: two stores (two
processes' worth of clients) on one Redis, the real planner's fill loop, Redis killed,
hung, full, wiped and restarted, key expiry, and a cluster.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from proxy.core.match import tenant_root
from proxy.core.plan import TurnPlan, plan_turn, turn_write
from proxy.core.policy import Policy
from proxy.core.record import Reply
from proxy.errors import ConfigError, StoreError
from proxy.store.base import AsyncStore, SessionTotals, StoreView, TurnWrite
from proxy.store.local import LocalStore
from proxy.store.memory.store import MemoryStore
from proxy.store.redis.store import CHILDREN_LIMIT, WRITE, RedisStore, RedisView, is_redis_url
from tests.conftest import need_redis
from tests.core.factories import assistant, call, make_chat, result, system, user
from tests.store.redis_server import (
    RedisClusterProcesses,
    RedisServer,
)

BIG = 10**12
SECRET = b"redis-test-secret-0123456789abcd"
POLICY = Policy()


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(redis: RedisServer) -> RedisServer:
    """The standalone Redis of this module (``redis`` in tests/conftest.py)."""
    return redis


@pytest.fixture
def prefix() -> str:
    """A key prefix of its own per test: tests share one server without seeing each other."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def redis_pair(server: RedisServer, prefix: str) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    """Two stores on one Redis: what two kvwarm processes hold."""
    a = RedisStore(server.url, ttl_seconds=60, prefix=prefix, timeout=1.0)
    b = RedisStore(server.url, ttl_seconds=60, prefix=prefix, timeout=1.0)
    await a.open()
    await b.open()
    yield a, b
    await a.close()
    await b.close()


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, clock: Any) -> AsyncIterator[AsyncStore]:
    """The same contract on both backends (the clock stamps session updates in both)."""
    if request.param == "memory":
        local = LocalStore(MemoryStore(60, BIG, SECRET, clock=clock))
        await local.open()
        yield local
        await local.close()
        return
    srv: RedisServer = request.getfixturevalue("server")
    shared = RedisStore(srv.url, ttl_seconds=60, secret=SECRET, prefix=request.getfixturevalue("prefix"), clock=clock)
    await shared.open()
    yield shared
    await shared.close()


def view_of(store: AsyncStore, tenant: bytes) -> StoreView:
    return store.view(tenant) if isinstance(store, RedisStore) else store.view()


async def read(store: AsyncStore, tenant: bytes, fn: Callable[[StoreView], Any], rounds: int = 3) -> Any:
    """``fn(view)`` with the request path's fill loop: plan, fill what was missing, plan again."""
    view = view_of(store, tenant)
    out = fn(view)
    for _ in range(rounds):
        if not view.missing:
            break
        await store.fill(view)
        out = fn(view)
    assert not view.missing, "the reads were not answered within the rounds"
    return out


def keys(nodes: Sequence[Any]) -> list[bytes]:
    return [n.key for n in nodes]


def totals(n: int, t: float, **kw: Any) -> SessionTotals:
    return SessionTotals(turns=1, prompt_tokens=100 * n, completion_tokens=n, cost_usd=0.1 * n, created=t, updated=t, model="m", **kw)


# -- the contract, on both backends --------------------------------------------------------------


async def test_reads_through_a_view(store: AsyncStore, tenant, make_path, make_tenant):
    long = "x" * 5000  # a blob, not an inline body
    a = make_path(tenant, [("system", long), "hi", ("assistant", "hello")])
    b = make_path(tenant, [("system", long), "bye"])
    c = make_path(tenant, ["hi"])  # the same message at depth 1, under another parent
    assert await store.insert(a) == 4
    assert await store.insert(b) == 1
    assert await store.insert(c) == 1
    other = make_tenant("bob")

    def reads(view: StoreView) -> dict[str, Any]:
        return {
            "get": [view.get(k) for k in keys(a + b)],
            "absent": view.get(b"\x00" * 16),
            "roots": keys(view.children(tenant)),
            "kids": keys(view.children(a[1].key)),
            "leaf": keys(view.children(a[-1].key)),
            "same": sorted(n.depth for n in view.by_identity(tenant, c[1].identity)),
            "elsewhere": list(view.by_identity(other, a[2].identity)),
        }

    got = await read(store, tenant, reads)
    assert got["get"] == a + b
    assert got["get"][1].body == long.join(['{"role":"system","content":"', '"}']).encode()
    assert got["absent"] is None
    assert got["roots"] == [a[0].key]
    assert got["kids"] == [a[2].key, b[2].key], "oldest first"
    assert got["leaf"] == []
    assert got["same"] == [1, 2]
    assert got["elsewhere"] == []
    assert await store.path(a[-1].key) == a
    assert await store.path(b"\x01" * 16) == []


async def test_write_turn_moves_totals_down_the_path(store: AsyncStore, tenant, make_path):
    t1 = make_path(tenant, [("system", "s"), "q1", ("assistant", "a1")])
    t2 = make_path(tenant, [("system", "s"), "q1", ("assistant", "a1"), "q2", ("assistant", "a2")])
    fork = make_path(tenant, [("system", "s"), "other"])
    await store.write_turn(TurnWrite(nodes=t1, path=(), leaf=t1[-1].key, totals=totals(1, 10.0), now=10.0))
    await store.write_turn(TurnWrite(nodes=t2[4:], path=keys(t2[:4]), leaf=t2[-1].key, totals=totals(2, 20.0, last_break="content_changed"), now=20.0))
    await store.write_turn(TurnWrite(nodes=fork[2:], path=keys(fork[:2]), leaf=fork[-1].key, totals=totals(4, 30.0, billed=True), now=30.0))

    sessions = await store.sessions(tenant)
    assert [(s.leaf, s.depth) for s in sessions] == [(fork[-1].key, 2), (t2[-1].key, 5)], "latest first"
    moved = sessions[1].totals
    assert moved == SessionTotals(
        turns=2, prompt_tokens=300, completion_tokens=3, cost_usd=0.1 + 0.2,
        last_break="content_changed", model="m", created=10.0, updated=20.0,
    )
    assert sessions[0].totals.billed and sessions[0].totals.turns == 1
    assert await store.totals(t1[-1].key) is None, "moved away"
    assert await store.totals(t2[-1].key) == moved
    assert await store.sessions() == sessions


async def test_add_turn(store: AsyncStore, tenant, make_path, clock):
    path = make_path(tenant, ["a", ("assistant", "b"), "c"])
    await store.insert(path)
    first = await store.add_turn(path[1].key, None, SessionTotals(prompt_tokens=5, model="m1"))
    assert first.turns == 1 and first.created == clock.now and first.updated == clock.now
    clock.advance(5)
    moved = await store.add_turn(path[3].key, path[1].key, SessionTotals(turns=1, cost_usd=0.25, billed=True))
    assert moved == SessionTotals(
        turns=2, prompt_tokens=5, cost_usd=0.25, billed=True, model="m1",
        created=first.created, updated=clock.now,
    )
    assert await store.totals(path[1].key) is None
    # A leaf that is not stored: the combined numbers come back, nothing is kept.
    ghost = await store.add_turn(b"\x02" * 16, path[3].key, SessionTotals(turns=1))
    assert ghost.turns == 3
    assert await store.totals(path[3].key) == moved
    assert [s.leaf for s in await store.sessions(tenant)] == [path[3].key]


async def test_insert_skips_orphans_and_wrong_depths(store: AsyncStore, tenant, make_path):
    path = make_path(tenant, ["a", "b", "c"])
    assert await store.insert(path[2:]) == 0, "parent missing: skipped"
    assert await store.insert([path[0], path[2]]) == 1
    bad = replace(path[1], depth=5)
    assert await store.insert([bad]) == 0
    assert await store.path(path[2].key) == []


async def test_backends_agree_on_a_random_forest(server, prefix, make_path, make_tenant, clock):
    """Many paths in two tenants, then every read compared between memory and redis."""
    import random

    rng = random.Random(7)
    memory = LocalStore(MemoryStore(60, BIG, SECRET, clock=clock))
    shared = RedisStore(server.url, ttl_seconds=60, secret=SECRET, prefix=prefix, clock=clock)
    await shared.open()
    try:
        tenants = [make_tenant("t1"), make_tenant("t2")]
        every: list[Any] = []
        for i in range(40):
            t = rng.choice(tenants)
            msgs = [rng.choice(["hi", "go", ("assistant", "ok"), ("system", "s" * rng.choice([10, 2000]))]) for _ in range(rng.randint(1, 6))]
            nodes = make_path(t, msgs)
            leaf = nodes[-1].key
            for s in (memory, shared):
                await s.write_turn(TurnWrite(nodes=nodes, path=(), leaf=leaf, totals=totals(i, float(i)), now=float(i)))
            every.extend(nodes)
        for t in tenants:
            mine = [n for n in every if n.tenant == t]

            def reads(view: StoreView, mine: list[Any] = mine, t: bytes = t) -> Any:
                return (
                    [view.get(n.key) for n in mine],
                    [keys(view.children(n.key)) for n in mine],
                    keys(view.children(t)),
                    [keys(view.by_identity(t, n.identity)) for n in mine],
                )

            assert await read(shared, t, reads) == await read(memory, t, reads)
            assert await shared.sessions(t) == await memory.sessions(t)
        for n in every[::5]:
            assert await shared.path(n.key) == await memory.path(n.key)
    finally:
        await shared.close()


# -- two processes on one Redis ----------------------------------------------------------------


async def test_two_stores_share_one_secret(redis_pair, server, prefix):
    a, b = redis_pair
    assert len(a.secret()) == 32 and a.secret() == b.secret()
    assert server.cli("strlen", f"{prefix}:secret") == "32"
    mine = RedisStore(server.url, ttl_seconds=60, secret=b"configured", prefix=prefix)
    await mine.open()
    assert mine.secret() == b"configured"
    await mine.close()


async def test_concurrent_inserts_converge(redis_pair, tenant, make_path):
    a, b = redis_pair
    paths = [make_path(tenant, [("system", "s"), f"q{i}", ("assistant", f"a{i}"), f"r{i}"]) for i in range(20)]
    flat = [n for p in paths for n in p]
    added = await asyncio.gather(*(s.insert(p) for p in paths for s in (a, b)))
    distinct = {n.key for n in flat}
    assert sum(added) == len(distinct), "each node inserted exactly once across both writers"
    fresh = RedisStore(a.url, ttl_seconds=60, prefix=a._prefix)
    await fresh.open()
    try:
        kids = await read(fresh, tenant, lambda v: keys(v.children(paths[0][1].key)))
        assert sorted(kids) == sorted({p[2].key for p in paths}) and len(kids) == len(paths)
        roots = await read(fresh, tenant, lambda v: keys(v.children(tenant)))
        assert roots == [paths[0][0].key]
    finally:
        await fresh.close()


def reply_to(i: int) -> Reply:
    if i == 0:
        msg = assistant(None, call("c1", "search", '{"query":"a","limit":1}'), call("c2", "search", '{"query":"b"}'))
    else:
        msg = assistant(f"answer {i}\n")
    return Reply(message=msg, finish_reason="stop", partial=False, model="m")


def conversation(turn: int) -> dict[str, Any]:
    """The request of turn ``turn`` of a scripted agent session, with the drifts clients make."""
    msgs: list[Any] = [system("You are terse."), user("find a and b")]
    if turn >= 1:
        # The tool calls echoed with re-serialized arguments, in another order: a repair.
        msgs.append(assistant("", call("c2", "search", {"query": "b"}), call("c1", "search", {"limit": 1, "query": "a"})))
        results = [result("c2", "B"), result("c1", "A")]
        if turn >= 2:
            results.reverse()  # the results re-sent in another order: restored as a group
        msgs.extend(results)
    for j in range(1, turn):
        text = f"answer {j}\n" if j != 1 or turn < 4 else "answer 1"  # stripped whitespace
        msgs.append(assistant(text))
        msgs.append(user(f"more {j}" if not (turn >= 5 and j == 2) else "more 2, edited"))
    return make_chat(*msgs, tools=[{"type": "function", "function": {"name": "search", "parameters": {}}}])


@dataclass
class Outcome:
    matched: int
    keys: int
    repairs: list[str]
    reason: str | None
    rounds: int


async def run_turn(store: AsyncStore, body: dict[str, Any], root: bytes, now: float, reply: Reply) -> Outcome:
    """The request path: plan against a view, fill what it missed (at most 3 rounds), plan again;
    then record the turn."""
    view = view_of(store, root)
    plan: TurnPlan = plan_turn(body, root, view, POLICY)
    if isinstance(view, RedisView) and plan.match is not None:
        view.want(plan.match.keys, plan.match.identities)
    rounds = 0
    while view.missing and rounds < 3:
        rounds += 1
        if await store.fill(view):  # False: every miss stayed absent, the plan stands
            plan = plan_turn(body, root, view, POLICY)
    write = turn_write(plan, reply, None, None, model="m", client_gone=False, now=now)
    assert write is not None and plan.match is not None
    await store.write_turn(write)
    return Outcome(
        plan.match.matched,
        len(plan.match.keys),
        [r.kind for r in plan.repair.repairs],
        plan.brk.reason if plan.brk else None,
        rounds,
    )


async def play(stores: Sequence[AsyncStore], root: bytes, turns: int = 7) -> list[Outcome]:
    """The scripted session, turn ``i`` sent through ``stores[i % len(stores)]``."""
    return [
        await run_turn(stores[i % len(stores)], conversation(i), root, 100.0 + i, reply_to(i))
        for i in range(turns)
    ]


async def test_real_planner_alternating_replicas(redis_pair, clock):
    a, b = redis_pair
    root = tenant_root(a.secret(), "sk-alice")
    memory = LocalStore(MemoryStore(60, BIG, a.secret(), clock=clock))

    expected = await play([memory], root)
    got = await play([a, b], root)

    assert [(o.matched, o.keys, o.repairs, o.reason) for o in got] == [
        (o.matched, o.keys, o.repairs, o.reason) for o in expected
    ]
    # The scenario exercises what it claims: each turn continues the previous one, written
    # by the other replica, with repairs and a real break along the way.
    continued = [i for i in range(1, len(got)) if got[i].reason == "new_branch"]
    assert len(continued) == len(got) - 2
    for i in continued:
        assert got[i].matched == got[i - 1].keys + 1, "turn i-1 and its reply, written via the other replica"
    assert {"arguments", "tool_calls_order", "tool_results_order", "whitespace"} <= {k for o in got for k in o.repairs}
    assert "content_changed" in [o.reason for o in got]
    assert max(o.rounds for o in got) <= 2, "a break or a reordered group costs one more round, not more"
    assert sum(o.rounds == 1 for o in got) >= len(got) - 2
    assert await a.sessions(root) == await b.sessions(root) == await memory.sessions(root)
    assert a.counters.fills > 0 and a.counters.hits > 0


async def test_a_session_written_via_a_matches_fully_via_b(redis_pair):
    a, b = redis_pair
    root = tenant_root(a.secret(), "sk-bob")
    await run_turn(a, conversation(3), root, 1.0, reply_to(3))
    # The same request again, now through b (which never saw it), plus a's reply.
    body = conversation(3)
    body["messages"].append(reply_to(3).message)
    view = b.view(root)
    plan = plan_turn(body, root, view, POLICY)
    assert plan.match is not None
    view.want(plan.match.keys)
    await b.fill(view)
    plan = plan_turn(body, root, view, POLICY)
    assert plan.match is not None and plan.match.complete
    assert plan.brk is None and not view.missing, "one fill answered the whole request"


async def test_admin_calls_find_the_tenant_of_a_bare_leaf(redis_pair, tenant, make_path):
    """The admin API may name only a leaf: a store that never saw it finds its tenant."""
    a, _ = redis_pair
    path = make_path(tenant, ["hello", ("assistant", "hi")])
    await a.write_turn(TurnWrite(nodes=path, path=(), leaf=path[-1].key, totals=totals(1, 1.0), now=1.0))
    fresh = RedisStore(a.url, ttl_seconds=60, prefix=a._prefix, cache_bytes=0)
    await fresh.open()
    try:
        assert await fresh.path(path[-1].key) == path
        assert (await fresh.totals(path[-1].key)) == (await a.totals(path[-1].key, tenant))
        assert await fresh.path(b"\x05" * 16) == []
    finally:
        await fresh.close()


async def test_a_long_path(redis_pair, tenant, make_path):
    a, b = redis_pair
    long = make_path(tenant, [f"m{i}" for i in range(1500)])
    await a.write_turn(TurnWrite(nodes=long, path=(), leaf=long[-1].key, totals=totals(1, 1.0), now=1.0))
    more = make_path(tenant, [*(f"m{i}" for i in range(1500)), "next"])
    await b.write_turn(TurnWrite(nodes=more[-1:], path=keys(more[:-1]), leaf=more[-1].key, totals=totals(1, 2.0), now=2.0))
    assert b.counters.healed == 0
    assert await a.path(more[-1].key, tenant) == more
    assert (await a.totals(more[-1].key, tenant)).turns == 2  # type: ignore[union-attr]


async def test_a_retried_write_is_counted_once(redis_pair, tenant, make_path):
    """redis-py retries a command whose reply was lost: the turn's totals must not double."""
    a, _ = redis_pair
    client = a._client
    sent = client.execute_command

    async def twice(*args: Any, **kw: Any) -> Any:
        if args[:2] == ("EVALSHA", WRITE.sha):
            await sent(*args, **kw)  # applied, and its reply lost on the way back
        return await sent(*args, **kw)

    client.execute_command = twice  # type: ignore[method-assign]
    path = make_path(tenant, ["once"])
    await a.write_turn(TurnWrite(nodes=path, path=(), leaf=path[-1].key, totals=totals(1, 1.0), now=1.0))
    again = await a.add_turn(path[-1].key, None, totals(1, 2.0))
    client.execute_command = sent  # type: ignore[method-assign]
    assert again.turns == 2
    assert (await a.totals(path[-1].key, tenant)) == again


# -- failure -----------------------------------------------------------------------------------


async def test_starting_while_redis_is_down(tmp_path: Path, tenant, make_path):
    """Open never fails on Redis being away: the store waits degraded, and so does the secret."""
    need_redis()
    srv = RedisServer(tmp_path / "r")
    store = RedisStore(srv.url, ttl_seconds=60, timeout=0.3, probe_backoff=(0.02, 0.1))
    await store.open()
    try:
        assert store.health().startswith("degraded: ")
        with pytest.raises(StoreError):
            store.secret()
        with pytest.raises(StoreError):
            await store.insert(make_path(tenant, ["x"]))
        srv.start()
        await wait_for(lambda: store.health() == "ok", 5)
        assert len(store.secret()) == 32
        assert await store.insert(make_path(tenant, ["x"])) == 2
    finally:
        await store.close()
        srv.stop()



async def wait_for(predicate: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_killed_redis_fails_fast_and_recovers(tmp_path: Path, tenant, make_path):
    need_redis()
    srv = RedisServer(tmp_path / "r", extra=["--appendonly", "yes", "--appendfsync", "always"]).start()
    store = RedisStore(srv.url, ttl_seconds=60, secret=SECRET, timeout=0.5, probe_backoff=(0.02, 0.1))
    await store.open()
    try:
        path = make_path(tenant, ["hello", ("assistant", "hi")])
        await store.write_turn(TurnWrite(nodes=path, path=(), leaf=path[-1].key, totals=totals(1, 1.0), now=1.0))
        assert store.health() == "ok"

        srv.kill()
        view = store.view(tenant)
        view.get(b"\x03" * 16)
        started = time.monotonic()
        with pytest.raises(StoreError):
            await store.fill(view)
        for call_ in (
            lambda: store.write_turn(TurnWrite(nodes=path, path=(), leaf=path[-1].key, totals=totals(1, 2.0), now=2.0)),
            lambda: store.sessions(tenant),
            lambda: store.path(path[-1].key, tenant),
            lambda: store.totals(path[-1].key, tenant),
            lambda: store.insert(path),
        ):
            with pytest.raises(StoreError):
                await call_()
        assert time.monotonic() - started < 0.5, "failures are immediate, not timeouts"
        assert store.health().startswith("degraded: ")
        assert store.secret() == SECRET, "the secret stays usable while degraded"

        srv.start()
        await wait_for(lambda: store.health() == "ok", 5)
        assert await store.path(path[-1].key, tenant) == path, "read again, same store object"
        assert [s.leaf for s in await store.sessions(tenant)] == [path[-1].key]
        assert store.counters.errors >= 6
    finally:
        await store.close()
        srv.stop()


async def test_hung_redis_times_out_and_recovers(tmp_path: Path, tenant, make_path):
    need_redis()
    srv = RedisServer(tmp_path / "r").start()
    store = RedisStore(srv.url, ttl_seconds=60, secret=SECRET, timeout=0.3, probe_backoff=(0.02, 0.1))
    await store.open()
    try:
        path = make_path(tenant, ["hello"])
        await store.insert(path)
        srv.pause()
        started = time.monotonic()
        with pytest.raises(StoreError):
            await store.sessions(tenant)
        assert time.monotonic() - started < 1.0
        assert store.health().startswith("degraded: ")
        started = time.monotonic()
        with pytest.raises(StoreError):
            await store.insert(path)
        assert time.monotonic() - started < 0.05, "the breaker answers at once while degraded"
        srv.resume()
        await wait_for(lambda: store.health() == "ok", 5)
        assert await store.path(path[-1].key, tenant) == path
    finally:
        srv.resume()
        await store.close()
        srv.stop()


async def test_the_callers_timeout_trips_the_breaker(tmp_path: Path, tenant):
    """The request path bounds its awaits itself: a cancel after a long wait means Redis is slow."""
    need_redis()
    srv = RedisServer(tmp_path / "r").start()
    store = RedisStore(srv.url, ttl_seconds=60, secret=SECRET, timeout=0.4, probe_backoff=(0.02, 0.1))
    await store.open()
    try:
        srv.pause()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await store.sessions(tenant)
        assert store.health().startswith("degraded: redis slow")
    finally:
        srv.resume()
        await store.close()
        srv.stop()


async def test_full_redis_raises_and_reads_still_work(server, prefix, tenant, make_path):
    store = RedisStore(server.url, ttl_seconds=60, secret=SECRET, prefix=prefix)
    fresh = RedisStore(server.url, ttl_seconds=60, secret=SECRET, prefix=prefix)
    await store.open()
    await fresh.open()
    path = make_path(tenant, ["a", ("assistant", "b")])
    more = make_path(tenant, ["a", ("assistant", "b"), "c"])
    turn = TurnWrite(nodes=more[2:], path=keys(more[:2]), leaf=more[-1].key, totals=totals(1, 1.0), now=1.0)
    try:
        await store.insert(path)
        server.cli("config", "set", "maxmemory-policy", "noeviction")
        server.cli("config", "set", "maxmemory", "1")
        try:
            with pytest.raises(StoreError, match="maxmemory"):
                await store.write_turn(turn)
            assert store.health().startswith("degraded: redis out of memory")
            got = await read(fresh, tenant, lambda v: v.get(path[1].key))
            assert got == path[1], "reads are no-writes scripts: they work while Redis is full"
        finally:
            server.cli("config", "set", "maxmemory", "0")
        await store.write_turn(turn)
        assert store.health() == "ok"
        assert await fresh.path(more[-1].key, tenant) == more
    finally:
        await store.close()
        await fresh.close()


async def test_a_wiped_redis_is_healed_from_the_process_cache(redis_pair, server, tenant, make_path):
    """Redis restarted without persistence: the next turn puts its matched path back."""
    a, b = redis_pair
    t1 = make_path(tenant, [("system", "s"), "q1", ("assistant", "a1")])
    await a.write_turn(TurnWrite(nodes=t1, path=(), leaf=t1[-1].key, totals=totals(1, 1.0), now=1.0))
    for key in server.cli("--scan", "--pattern", f"{a._prefix}:{{*").split():
        server.cli("del", key)
    t2 = make_path(tenant, [("system", "s"), "q1", ("assistant", "a1"), "q2"])
    await a.write_turn(TurnWrite(nodes=t2[3:], path=keys(t2[:3]), leaf=t2[-1].key, totals=totals(1, 2.0), now=2.0))
    assert a.counters.healed == 3
    assert await b.path(t2[-1].key, tenant) == t2


async def test_unknown_tenant_of_a_view_is_an_error_not_a_guess(redis_pair):
    a, _ = redis_pair
    view = a.view()
    assert view.get(b"\x04" * 16) is None
    with pytest.raises(StoreError, match="tenant"):
        await a.fill(view)


# -- expiry ------------------------------------------------------------------------------------


async def test_sliding_ttl(server, prefix, tenant, make_path):
    store = RedisStore(server.url, ttl_seconds=0.6, secret=SECRET, prefix=prefix)
    await store.open()
    try:
        kept = make_path(tenant, ["kept", ("assistant", "x" * 3000)])
        dropped = make_path(tenant, ["dropped"])
        await store.write_turn(TurnWrite(nodes=kept, path=(), leaf=kept[-1].key, totals=totals(1, time.time()), now=time.time()))
        await store.write_turn(TurnWrite(nodes=dropped, path=(), leaf=dropped[-1].key, totals=totals(1, time.time()), now=time.time()))
        await asyncio.sleep(0.4)
        more = make_path(tenant, ["kept", ("assistant", "x" * 3000), "on"])
        now = time.time()
        await store.write_turn(TurnWrite(nodes=more[3:], path=keys(more[:3]), leaf=more[-1].key, totals=totals(1, now), now=now))
        await asyncio.sleep(0.35)
        # 0.75 s after the first writes: the touched path lives on, the other session expired.
        fresh = RedisStore(server.url, ttl_seconds=0.6, secret=SECRET, prefix=prefix, cache_bytes=0)
        await fresh.open()
        assert await fresh.path(more[-1].key, tenant) == more
        assert await fresh.path(dropped[-1].key, tenant) == []
        assert [s.leaf for s in await fresh.sessions(tenant)] == [more[-1].key]
        await asyncio.sleep(0.7)
        assert await fresh.path(more[-1].key, tenant) == []
        assert await fresh.sessions(tenant) == []
        left = server.cli("--scan", "--pattern", f"{prefix}:{{*").split()
        assert all(":w:" in k for k in left), "only the write tokens (60 s) are left"
        await fresh.close()
    finally:
        await store.close()


# -- the process cache and counters ------------------------------------------------------------


async def test_cache_is_bounded_and_counts(server, prefix, tenant, make_path):
    store = RedisStore(server.url, ttl_seconds=60, secret=SECRET, prefix=prefix, cache_bytes=20_000)
    await store.open()
    try:
        path = make_path(tenant, [f"message {i} " + "y" * 2000 for i in range(30)])
        await store.insert(path)
        stats = store.stats()
        assert stats.bytes <= 20_000 and stats.evicted > 0 and 0 < stats.nodes < len(path)
        got = await read(store, tenant, lambda v: [v.get(k) for k in keys(path)])
        assert got == path
        assert store.counters.misses > 0 and store.counters.hits > 0
    finally:
        await store.close()


async def test_children_are_the_newest_few(server, prefix, tenant, make_path):
    store = RedisStore(server.url, ttl_seconds=60, secret=SECRET, prefix=prefix)
    await store.open()
    try:
        paths = [make_path(tenant, ["root", f"child {i}"]) for i in range(CHILDREN_LIMIT + 8)]
        for p in paths:
            await store.insert(p)
        kids = await read(store, tenant, lambda v: keys(v.children(paths[0][1].key)))
        assert kids == [p[2].key for p in paths[-CHILDREN_LIMIT:]]
    finally:
        await store.close()


# -- URLs --------------------------------------------------------------------------------------


def test_urls():
    assert is_redis_url("redis://h:1/0") and is_redis_url("rediss://h:1") and is_redis_url("unix:///s.sock?db=2")
    assert is_redis_url("redis+cluster://a:1,b:2") and not is_redis_url("sqlite:x.db") and not is_redis_url("memory")
    with pytest.raises(ConfigError):
        RedisStore("memory", ttl_seconds=1)
    for bad in ("redis://h:port", "redis+cluster://h", "redis+cluster://h:1/3", "redis+cluster://h:1?db=2"):
        with pytest.raises(ConfigError, match=r"store\.backend"):
            RedisStore(bad, ttl_seconds=1)
    with pytest.raises(ConfigError):
        RedisStore("redis://h:1", ttl_seconds=1, prefix="a{b}")
    assert RedisStore("redis+cluster://:pw@a:1,[::1]:2", ttl_seconds=1)._cluster == ([("a", 1), ("::1", 2)], None, "pw", False)


async def test_unix_socket_url(tmp_path: Path, tenant, make_path):
    need_redis()
    sock = tmp_path / "redis.sock"
    srv = RedisServer(tmp_path / "r", extra=["--unixsocket", str(sock), "--unixsocketperm", "700"]).start()
    store = RedisStore(f"unix://{sock}?db=3", ttl_seconds=60, secret=SECRET)
    await store.open()
    try:
        path = make_path(tenant, ["over a socket"])
        assert await store.insert(path) == 2
        assert srv.cli("-n", "3", "dbsize") != "0" and srv.cli("-n", "0", "dbsize") == "0"
    finally:
        await store.close()
        srv.stop()


# -- cluster -----------------------------------------------------------------------------------


async def test_cluster_alternating_replicas(cluster: RedisClusterProcesses, clock):
    a = RedisStore(cluster.url, ttl_seconds=60, timeout=2.0)
    b = RedisStore(cluster.url, ttl_seconds=60, timeout=2.0)
    await a.open()
    await b.open()
    try:
        assert a.health() == "ok" and a.secret() == b.secret()
        memory = LocalStore(MemoryStore(60, BIG, a.secret(), clock=clock))
        roots = [tenant_root(a.secret(), f"sk-{i}") for i in range(6)]
        for root in roots:
            got = await play([a, b], root, turns=6)
            expected = await play([memory], root, turns=6)
            assert [(o.matched, o.repairs, o.reason) for o in got] == [(o.matched, o.repairs, o.reason) for o in expected]
        listed = await b.sessions()
        assert {s.tenant for s in listed} == set(roots)
        # Every tenant's sessions end at the same times here: compare without the order of ties.
        assert sorted(listed, key=lambda s: s.leaf) == sorted(await memory.sessions(), key=lambda s: s.leaf)
        assert [s.totals.updated for s in listed] == sorted((s.totals.updated for s in listed), reverse=True)
        used = [int(n.cli("dbsize")) for n in cluster.nodes]
        assert sum(1 for u in used if u > 0) >= 2, f"tenants spread over the masters: {used}"
    finally:
        await a.close()
        await b.close()


def test_protocols():
    store = RedisStore("redis://127.0.0.1:1", ttl_seconds=1)
    assert isinstance(store, AsyncStore)
    assert isinstance(store.view(b"t" * 16), RedisView) and isinstance(store.view(), StoreView)
