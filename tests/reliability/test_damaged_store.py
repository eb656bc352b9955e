"""A damaged sqlite store is moved aside and kvwarm starts empty; it never keeps kvwarm from starting.

A real store file (200 sessions, several hundred pages) is damaged four ways: random bytes over
its header, cut to half its length, a page of zeros over the root page of the ``nodes`` table in
the middle of the file, and a ``sessions`` table with other columns. Then a real kvwarm
(``create_app`` on the reference upstream, driven with the openai SDK; and once the real
``kvwarm serve`` command) must start and serve chat requests. Today it fails to start:
``database disk image is malformed`` / ``file is not a database``, exit status 1.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import sqlite3
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from proxy.core.match import tenant_root
from proxy.errors import StoreError
from proxy.store.sqlite.store import SqliteStore
from tests.conftest import ProxyFactory, metric, sim_url
from tests.reliability.conftest import free_port
from tests.test_inspect_cli import session_nodes

SECRET = "d" * 32
KINDS = ["garbage_header", "truncated", "zeroed_page", "wrong_schema"]


async def build_store(db: Path) -> None:
    store = SqliteStore(db, 3600.0, 1 << 30, SECRET.encode())
    await store.open()
    root = tenant_root(store.secret(), "Bearer sk-alice")
    for i in range(200):
        nodes, totals = session_nodes(root, f"question {i} " + "x" * 500)
        store.insert(nodes)
        store.add_turn(nodes[-1].key, None, totals)
    await store.close()


def damage(db: Path, kind: str) -> None:
    size = db.stat().st_size
    if kind == "garbage_header":
        with db.open("r+b") as f:
            f.write(os.urandom(100))
    elif kind == "truncated":
        os.truncate(db, size // 2)
    elif kind == "zeroed_page":
        with sqlite3.connect(db) as conn:
            page_size = conn.execute("PRAGMA page_size").fetchone()[0]
            (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'nodes'").fetchone()
        conn.close()
        assert 1 < root < size // page_size, "the nodes table's root page lies inside the file"
        with db.open("r+b") as f:
            f.seek((root - 1) * page_size)
            f.write(b"\0" * page_size)
    elif kind == "wrong_schema":
        with sqlite3.connect(db) as conn:
            conn.execute("DROP TABLE sessions")
            conn.execute("CREATE TABLE sessions (leaf BLOB PRIMARY KEY, note TEXT)")
        conn.close()
    # A write-ahead log left beside it must go aside with it, never meet the new file.
    Path(f"{db}-wal").write_bytes(b"left-over write-ahead log")


@pytest.fixture
async def damaged_db(tmp_path: Path, request: Any) -> tuple[Path, str, bytes]:
    db = tmp_path / "kv.db"
    await build_store(db)
    damage(db, request.param)
    return db, request.param, hashlib.sha256(db.read_bytes()).digest()


def contents(path: Path) -> bytes:
    return path.read_bytes()


def chat(text: str) -> dict[str, Any]:
    return {"model": "kvwarm-sim", "messages": [{"role": "user", "content": text}]}


@pytest.mark.parametrize("damaged_db", KINDS, indirect=True)
async def test_kvwarm_starts_on_a_damaged_store_and_serves(
    damaged_db: tuple[Path, str, bytes], make_proxy: ProxyFactory, sim: TestServer, openai_client: Any, caplog: Any
) -> None:
    db, kind, digest = damaged_db
    caplog.set_level(logging.INFO)
    proxy = await make_proxy(sim, store__backend=f"sqlite:{db}", store__secret=SECRET)
    client = openai_client(proxy)
    first = await client.chat.completions.create(**chat("hello after the damage"))
    second = await client.chat.completions.create(
        **chat("hello after the damage") | {"messages": [
            {"role": "user", "content": "hello after the damage"},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "and again"},
        ]}
    )
    assert first.choices[0].message.content and second.choices[0].message.content

    (aside,) = [
        p for p in db.parent.iterdir() if p.name.startswith("kv.db.damaged-") and not p.name.endswith(("-wal", "-shm"))
    ]
    assert hashlib.sha256(aside.read_bytes()).digest() == digest, "the damaged file is kept, unchanged"
    assert contents(aside.with_name(aside.name + "-wal")) == b"left-over write-ahead log"
    stamp = aside.name.removeprefix("kv.db.damaged-")
    assert len(stamp) == 16 and stamp.endswith("Z") and stamp[8] == "T", stamp
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "proxy.store.sqlite.store"]
    assert len(errors) == 1 and "moved it aside" in errors[0].getMessage(), kind
    assert metric(proxy, "kvwarm_store_corrupt_entries") >= 1

    await proxy.close()  # flushes the new store
    fresh = SqliteStore(db, 3600.0, 1 << 30, SECRET.encode(), set_aside_damaged=False)
    await fresh.open()
    try:
        assert fresh.stats().nodes >= 3 and fresh.stats().corrupt == 0, "the new file holds the new turns"
    finally:
        await fresh.close()


@pytest.mark.parametrize("damaged_db", ["garbage_header"], indirect=True)
async def test_readers_report_a_damaged_store_and_leave_it_in_place(damaged_db: tuple[Path, str, bytes]) -> None:
    """``kvwarm sessions`` and friends may run beside a server: they never move its file."""
    db, _kind, digest = damaged_db
    with pytest.raises(StoreError, match="not a database"):
        await SqliteStore(db, 3600.0, 1 << 30, SECRET.encode(), set_aside_damaged=False).open()
    assert hashlib.sha256(db.read_bytes()).digest() == digest
    assert not [p for p in db.parent.iterdir() if ".damaged-" in p.name]


async def test_another_applications_database_is_refused_not_moved(tmp_path: Path) -> None:
    db = tmp_path / "places.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE moz_places (id INTEGER PRIMARY KEY, url TEXT)")
    conn.close()
    before = db.read_bytes()
    with pytest.raises(StoreError, match="something else"):
        await SqliteStore(db, 3600.0, 1 << 30, SECRET.encode()).open()
    assert db.read_bytes() == before


@pytest.mark.parametrize("damaged_db", ["garbage_header"], indirect=True)
async def test_kvwarm_serve_starts_on_a_damaged_store(damaged_db: tuple[Path, str, bytes], sim: TestServer) -> None:
    db, _kind, _digest = damaged_db
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--port", str(port), "--upstream", sim_url(sim),
        "--store", f"sqlite:{db}", env={**os.environ, "KVWARM_STORE_SECRET": SECRET},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(300):
                assert proc.returncode is None, "kvwarm serve exited on a damaged store"
                try:
                    async with s.get(f"http://127.0.0.1:{port}/readyz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat("hi")) as r:
                assert r.status == 200
                assert (await r.json())["choices"][0]["message"]["content"]
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
    assert proc.returncode == 0
    assert proc.stderr is not None
    log = (await proc.stderr.read()).decode()
    assert "ERROR proxy.store.sqlite.store: store" in log and "moved it aside" in log
