"""SqliteStore: write-behind persistence, restart, integrity checks, the secret file."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import stat
from contextlib import closing

import pytest

from proxy.config import StoreSettings
from proxy.errors import StoreError
from proxy.store.base import SessionTotals, TranscriptStore
from proxy.store.factory import make_store
from proxy.store.sqlite.store import SqliteStore

BIG = 10**12
SLOW = 3600.0
"""A flush interval that never fires during a test: writes happen only on flush()."""


@pytest.fixture
def db(tmp_path):
    return tmp_path / "kv.db"


@pytest.fixture
async def opened(db, clock):
    """Open stores built by the test, all closed at teardown."""
    stores: list[SqliteStore] = []

    async def open_store(**kw) -> SqliteStore:
        kw.setdefault("flush_interval", SLOW)
        kw.setdefault("clock", clock)
        store = SqliteStore(db, kw.pop("ttl", 3600), kw.pop("max_bytes", BIG), **kw)
        await store.open()
        stores.append(store)
        return store

    yield open_store
    for store in stores:
        await store.close()


def raw(db) -> sqlite3.Connection:
    return sqlite3.connect(db)


def count(db, table: str) -> int:
    with closing(raw(db)) as conn:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def test_is_a_transcript_store(db):
    assert isinstance(SqliteStore(db, 60, BIG), TranscriptStore)


async def test_restart_keeps_nodes_totals_used_and_secret(opened, db, tenant, make_path, clock):
    store = await opened()
    a = make_path(tenant, [("system", "sys"), "hi", ("assistant", "hello")])
    b = make_path(tenant, [("system", "sys"), "other"])
    store.insert(a)
    store.insert(b)
    store.touch([n.key for n in a], 1234.5)
    store.add_turn(a[-1].key, None, SessionTotals(prompt_tokens=7, cost_usd=0.125, model="m", last_break="new_branch"))
    clock.advance(1)
    store.add_turn(b[-1].key, None, SessionTotals(prompt_tokens=3))
    secret = store.secret()
    before = store.stats()
    await store.close()

    again = await opened()
    assert again.secret() == secret
    assert again.path(a[-1].key) == a
    assert again.path(b[-1].key) == b
    assert [n.key for n in again.children(a[1].key)] == [a[2].key, b[2].key]
    assert again.totals(a[-1].key) == store.totals(a[-1].key)
    assert [s.leaf for s in again.sessions()] == [s.leaf for s in store.sessions()]
    assert again._used == store._used
    assert again.stats() == before


async def test_restart_keeps_the_lru_order(opened, tenant, make_path, clock):
    store = await opened()
    a, b = make_path(tenant, ["a"]), make_path(tenant, ["b"])
    store.insert(a)
    store.insert(b)
    store.touch([a[-1].key], clock.advance(10))  # b's leaf is now the LRU leaf
    await store.close()
    again = await opened()
    again._max_bytes = again.stats().bytes - 1
    assert again.evict(clock.now) == 1
    assert again.get(b[-1].key) is None and again.get(a[-1].key) is not None


async def test_writes_wait_for_flush(opened, db, tenant, make_path):
    store = await opened()
    wal = db.with_name(db.name + "-wal")
    files = {p: p.stat().st_mtime_ns for p in (db, wal) if p.exists()}
    sizes = {p: p.stat().st_size for p in files}
    store.insert(make_path(tenant, ["one", "two"]))
    store.add_turn(make_path(tenant, ["one", "two"])[-1].key, None, SessionTotals(turns=1))
    await asyncio.sleep(0.05)
    assert count(db, "nodes") == 0 and count(db, "sessions") == 0
    assert {p: p.stat().st_mtime_ns for p in files} == files
    assert {p: p.stat().st_size for p in files} == sizes
    await store.flush()
    assert count(db, "nodes") == 3 and count(db, "sessions") == 1 and count(db, "blobs") == 3


async def test_background_task_flushes(opened, db, tenant, make_path):
    store = await opened(flush_interval=0.01)
    store.insert(make_path(tenant, ["x"]))
    for _ in range(200):
        if count(db, "nodes") == 2:
            break
        await asyncio.sleep(0.01)
    assert count(db, "nodes") == 2


async def test_close_flushes_and_stops_the_task(db, tenant, make_path):
    store = SqliteStore(db, 60, BIG, flush_interval=0.001)
    await store.open()
    task = store._task
    store.insert(make_path(tenant, ["x"]))
    await asyncio.sleep(0)
    await store.close()
    assert task.done()
    assert count(db, "nodes") == 2
    await store.close()  # idempotent
    with pytest.raises(StoreError):
        await store.flush()


async def test_concurrent_writers_and_flushes_persist_everything(opened, db, tenant, make_path):
    store = await opened(flush_interval=0.001)
    paths = [make_path(tenant, [("system", "s"), f"q{i % 7}", f"r{i}"]) for i in range(50)]

    async def writer(path):
        for end in range(1, len(path) + 1):
            store.insert(path[:end])
            await asyncio.sleep(0)
        if path[-1].key.startswith(b"\x00"):
            await store.flush()

    await asyncio.gather(*(writer(p) for p in paths))
    await store.close()
    again = await opened()
    for p in paths:
        assert again.path(p[-1].key) == p
    assert again.stats().nodes == len({n.key for p in paths for n in p})


async def test_failed_write_is_retried_in_order(opened, db, tenant, make_path, clock):
    store = await opened(ttl=60)
    store._conn.execute("PRAGMA busy_timeout = 10")  # fail fast while the test holds the lock
    early = make_path(tenant, ["early"])
    store.insert(early)
    with closing(sqlite3.connect(db, isolation_level=None)) as blocker:
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreError, match="locked"):
            await store.flush()
        # Changes made after the failed batch apply on top of it.
        later = make_path(tenant, ["later"])
        store.insert(later)
        store.touch([later[0].key, later[1].key], clock.advance(30))
        store.evict(clock.advance(40))  # "early" expires; element 0 stays, it was touched
        blocker.execute("ROLLBACK")
    await store.flush()
    with closing(raw(db)) as conn:
        keys = {k for (k,) in conn.execute("SELECT key FROM nodes")}
    assert keys == {later[0].key, later[1].key}


async def test_eviction_is_persisted(opened, db, make_path, make_tenant, clock):
    store = await opened(ttl=60)
    gone = make_path(make_tenant("a"), [("system", "only a"), "bye"])
    kept = make_path(make_tenant("b"), ["stay"])
    store.insert(gone)
    store.add_turn(gone[-1].key, None, SessionTotals(prompt_tokens=1))
    await store.flush()
    clock.advance(50)
    store.insert(kept)
    assert store.evict(clock.advance(20)) == 3
    await store.close()
    assert count(db, "nodes") == 2 and count(db, "sessions") == 0
    assert count(db, "blobs") == 2  # "[]" and "stay": gone's blobs were deleted with it
    again = await opened(ttl=60)
    assert again.get(gone[0].key) is None and again.path(kept[-1].key) == kept


def _corrupt_node(db, key: bytes, column: str, value) -> None:
    with closing(raw(db)) as conn, conn:
        assert conn.execute(f"UPDATE nodes SET {column} = ? WHERE key = ?", (value, key)).rowcount == 1


def _flip(value: bytes) -> bytes:
    return bytes([value[0] ^ 0x01]) + value[1:]


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("identity", lambda row: _flip(row["identity"])),
        ("role", lambda row: b"\xff\xfe"),  # not UTF-8
        ("role", lambda row: "assistant"),
        ("depth", lambda row: "two"),
        ("tokens", lambda row: row["tokens"] + 1),
        ("created", lambda row: row["created"] + 1),
        ("checksum", lambda row: _flip(row["checksum"])),
        ("body_hash", lambda row: _flip(row["body_hash"])),
    ],
)
async def test_corrupt_node_is_a_counted_miss(opened, db, tenant, make_path, caplog, column, value):
    store = await opened()
    broken = make_path(tenant, [("system", "s"), "secret words", "below", "deeper"])
    fine = make_path(tenant, [("system", "s"), "fine"])
    store.insert(broken)
    store.insert(fine)
    store.add_turn(broken[-1].key, None, SessionTotals(prompt_tokens=1))
    await store.close()
    with closing(raw(db)) as conn:
        conn.row_factory = sqlite3.Row
        row = conn.execute("SELECT * FROM nodes WHERE key = ?", (broken[2].key,)).fetchone()
    _corrupt_node(db, broken[2].key, column, value(row))

    with caplog.at_level(logging.WARNING, logger="proxy.store.sqlite.store"):
        again = await opened()
    assert again.stats().corrupt == 1
    assert again.path(fine[-1].key) == fine
    assert again.path(broken[-1].key) == []
    assert again.path(broken[3].key) == []
    assert again.get(broken[2].key) is None
    assert again.path(broken[1].key) == broken[:2]
    assert again.totals(broken[-1].key) is None
    assert "corrupt node" in caplog.text
    assert "secret words" not in caplog.text

    # The bad row is gone: the same key can be stored again and survives the next restart.
    again.insert(broken)
    await again.close()
    third = await opened()
    assert third.stats().corrupt == 0
    assert third.path(broken[-1].key) == broken


async def test_corrupt_blob_is_a_counted_miss(opened, db, make_path, make_tenant):
    store = await opened()
    shared = ("system", "shared prompt " * 100)
    one = make_path(make_tenant("a"), [shared, "x"])
    two = make_path(make_tenant("b"), [shared, "y"])
    other = make_path(make_tenant("c"), [("system", "different"), "z"])
    for p in (one, two, other):
        store.insert(p)
    await store.close()
    with closing(raw(db)) as conn, conn:
        (digest, data) = conn.execute("SELECT hash, data FROM blobs WHERE length(data) > 1000").fetchone()
        conn.execute("UPDATE blobs SET data = ? WHERE hash = ?", (_flip(data), digest))

    again = await opened()
    # The blob, and both nodes that needed it, failed; their descendants are unreachable.
    assert again.stats().corrupt == 3
    assert again.path(one[-1].key) == [] and again.path(two[-1].key) == []
    assert again.path(one[0].key) == one[:1]
    assert again.path(other[-1].key) == other


async def test_corrupt_session_is_a_counted_miss(opened, db, tenant, make_path):
    store = await opened()
    a, b = make_path(tenant, ["a"]), make_path(tenant, ["b"])
    store.insert(a)
    store.insert(b)
    store.add_turn(a[-1].key, None, SessionTotals(prompt_tokens=1))
    store.add_turn(b[-1].key, None, SessionTotals(prompt_tokens=2))
    await store.close()
    with closing(raw(db)) as conn, conn:
        conn.execute("UPDATE sessions SET data = ? WHERE leaf = ?", (b'{"turns": "lots"}', a[-1].key))
    again = await opened()
    assert again.stats().corrupt == 1
    assert again.totals(a[-1].key) is None
    assert again.totals(b[-1].key).prompt_tokens == 2
    assert again.path(a[-1].key) == a


async def test_secret_file_is_private_and_stable(opened, db):
    store = await opened()
    secret_file = db.with_name(db.name + ".secret")
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert secret_file.read_bytes() == store.secret() and len(store.secret()) == 32
    assert list(db.parent.glob("*.tmp")) == []


async def test_configured_secret_wins(opened, db):
    store = await opened(secret=b"configured")
    assert store.secret() == b"configured"
    assert not db.with_name(db.name + ".secret").exists()


async def test_bad_secret_file_refuses_to_open(db):
    db.with_name(db.name + ".secret").write_bytes(b"short")
    store = SqliteStore(db, 60, BIG)
    with pytest.raises(StoreError, match="expected 32"):
        await store.open()


def test_secret_before_open_is_an_error(db):
    with pytest.raises(StoreError):
        SqliteStore(db, 60, BIG).secret()


async def test_open_twice_is_an_error(opened):
    store = await opened()
    with pytest.raises(StoreError):
        await store.open()


async def test_schema_version_mismatch_refuses_to_open(opened, db):
    store = await opened()
    await store.close()
    with closing(raw(db)) as conn, conn:
        conn.execute("UPDATE meta SET value = '99' WHERE name = 'schema'")
    with pytest.raises(StoreError, match="schema version"):
        await SqliteStore(db, 60, BIG).open()


async def test_wal_mode(opened, db):
    await opened()
    with closing(raw(db)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_factory_sqlite_creates_directories(tmp_path):
    path = tmp_path / "deep" / "er" / "kv.db"
    wrapped = make_store(StoreSettings(backend=f"sqlite:{path}", ttl_seconds=60, max_bytes=BIG, flush_interval=0.1))
    store = wrapped.local
    assert isinstance(store, SqliteStore)
    assert store.db_path == path
    assert path.parent.is_dir()
