"""The ``sqlite`` backend: a :class:`~proxy.store.memory.MemoryStore` with write-behind persistence.

Every read is served by the in-memory index, so the request path never touches the
database. Changes reported by the index's hooks are coalesced into a pending batch;
a background task owned by the store (created in :meth:`SqliteStore.open`, cancelled
and awaited in :meth:`SqliteStore.close`) writes the batch every ``flush_interval``
seconds in one transaction, through ``asyncio.to_thread`` on one dedicated
connection (WAL, ``synchronous=NORMAL``).

Schema (version 1)::

    meta     (name TEXT PRIMARY KEY, value TEXT)            schema version
    blobs    (hash BLOB PRIMARY KEY, data BLOB)             bodies by blake2b-256 of data
    nodes    (key BLOB PRIMARY KEY, parent, tenant, depth, role, identity,
              body_hash, tokens, flags, created, used, checksum)
    sessions (leaf BLOB PRIMARY KEY, data BLOB, checksum)   SessionTotals as JSON

``nodes.checksum`` is a keyed blake2b of every column except ``used`` (which changes
on each touch); ``sessions.checksum`` covers the leaf and the JSON. On open, a blob
whose data does not hash to its key, a node whose columns do not decode or verify or
whose blob is missing, and a session that does not decode are skipped, logged (never
their content) and counted in ``StoreStats.corrupt``; nodes below a skipped node are
unreachable and are dropped like them. Skipped rows are deleted, so a later request
can store the same key again.

A damaged file -- sqlite reports it corrupt or not a database while it is opened
and read, or a kvwarm table has other columns than the schema's -- is moved aside
(``<name>.damaged-<UTC time>``, with its ``-wal``, ``-shm`` and ``-journal`` files
under the same new name, so sqlite can still open the copy for forensics), logged at
ERROR, counted as one entry in ``StoreStats.corrupt`` and listed in
:attr:`SqliteStore.set_aside`; the store then starts empty in a new file. A cache
never keeps kvwarm from starting. Not moved aside, but refused with
:class:`StoreError`: a file of another schema version (a newer kvwarm's store), a
sqlite database of another application (tables, but no kvwarm ``meta``), and
errors that are not damage (permissions, a lock held by another process). Read-only
users (``kvwarm sessions``, ``show``, ``export``) pass ``set_aside_damaged=False``:
they may run beside a server and must never move its file.

The memory index is the arbiter of insert-if-absent (the first node wins there), so
the database mirrors it with ``INSERT OR REPLACE``. One process owns a database file.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import secrets
import sqlite3
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from operator import itemgetter
from pathlib import Path
from typing import Any

import orjson

from ..errors import CorruptEntry, StoreError
from .base import Node, SessionTotals
from .memory import MemoryStore, blob_hash

logger = logging.getLogger(__name__)

SCHEMA_VERSION = "1"
SECRET_SIZE = 32
_LOGGED_CORRUPT = 20
"""Corrupt rows logged one by one on open; the rest are summed up in one line."""

_GENERATED = 1
_PARTIAL = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS blobs (
    hash BLOB PRIMARY KEY,
    data BLOB NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS nodes (
    key BLOB PRIMARY KEY,
    parent BLOB NOT NULL,
    tenant BLOB NOT NULL,
    depth INTEGER NOT NULL,
    role TEXT NOT NULL,
    identity BLOB NOT NULL,
    body_hash BLOB NOT NULL,
    tokens INTEGER NOT NULL,
    flags INTEGER NOT NULL,
    created REAL NOT NULL,
    used REAL NOT NULL,
    checksum BLOB NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sessions (
    leaf BLOB PRIMARY KEY,
    data BLOB NOT NULL,
    checksum BLOB NOT NULL
) WITHOUT ROWID;
"""

_DAMAGE_CODES = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})
"""Primary sqlite result codes that mean the file itself is damaged (not locked, not unreadable)."""
_SIDE_FILES = ("-wal", "-shm", "-journal")
_STAMP = "%Y%m%dT%H%M%SZ"

_NODE_COLUMNS = "key, parent, tenant, depth, role, identity, body_hash, tokens, flags, created, used, checksum"
_TOTALS_TYPES: dict[str, type] = {f.name: type(f.default) for f in fields(SessionTotals)}


def node_checksum(
    key: bytes,
    parent: bytes,
    tenant: bytes,
    depth: int,
    role: str,
    identity: bytes,
    body_hash: bytes,
    tokens: int,
    flags: int,
    created: float,
) -> bytes:
    """Checksum of a node row: every column but ``used``, length-prefixed so fields cannot shift."""
    h = hashlib.blake2b(digest_size=16, person=b"kvwarm-node-v1")
    for part in (key, parent, tenant, role.encode(), identity, body_hash):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    h.update(struct.pack(">qqqd", depth, tokens, flags, created))
    return h.digest()


def session_checksum(leaf: bytes, data: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16, person=b"kvwarm-sess-v1")
    h.update(len(leaf).to_bytes(4, "big"))
    h.update(leaf)
    h.update(data)
    return h.digest()


def encode_totals(totals: SessionTotals) -> bytes:
    return orjson.dumps({name: getattr(totals, name) for name in _TOTALS_TYPES})


def decode_totals(data: object) -> SessionTotals:
    """Totals from their JSON; raises :class:`CorruptEntry` on any missing, extra or mistyped field."""
    if not isinstance(data, bytes):
        raise CorruptEntry("session data is not a blob")
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise CorruptEntry("session data is not JSON") from exc
    if not isinstance(raw, dict) or raw.keys() != _TOTALS_TYPES.keys():
        raise CorruptEntry("session data has the wrong fields")
    values: dict[str, Any] = {}
    for name, kind in _TOTALS_TYPES.items():
        value = raw[name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not kind:
            raise CorruptEntry(f"session field {name} is not {kind.__name__}")
        values[name] = value
    return SessionTotals(**values)


def read_secret(path: Path) -> bytes:
    """The secret kept in ``path``; created (mode 0600, random bytes) when absent.

    Creation writes a private temporary file and hard-links it into place, so two
    processes opening at once agree on one secret and nobody reads a half-written file.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = _create_secret(path)
    except OSError as exc:
        raise StoreError(f"cannot read the store secret {path}: {exc.strerror}") from exc
    if len(data) != SECRET_SIZE:
        raise StoreError(f"the store secret {path} holds {len(data)} bytes, expected {SECRET_SIZE}")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        logger.warning("the store secret %s is readable by others (mode %o); expected 600", path, mode)
    return data


def _create_secret(path: Path) -> bytes:
    fresh = secrets.token_bytes(SECRET_SIZE)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, fresh)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return path.read_bytes()
        return fresh
    except OSError as exc:
        raise StoreError(f"cannot create the store secret {path}: {exc.strerror}") from exc
    finally:
        tmp.unlink(missing_ok=True)


@dataclass(slots=True)
class _Batch:
    """Changes not yet written, coalesced: per key, only the latest state matters.

    Puts and deletes of one kind are kept disjoint, so they can be applied in any order.
    """

    nodes: dict[bytes, tuple[Node, bytes]] = field(default_factory=dict)
    dropped: set[bytes] = field(default_factory=set)
    used: dict[bytes, float] = field(default_factory=dict)
    blobs: dict[bytes, bytes] = field(default_factory=dict)
    freed: set[bytes] = field(default_factory=set)
    totals: dict[bytes, SessionTotals] = field(default_factory=dict)
    ended: set[bytes] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.nodes or self.dropped or self.used or self.blobs or self.freed or self.totals or self.ended)

    def put_node(self, node: Node, digest: bytes) -> None:
        self.nodes[node.key] = (node, digest)
        self.dropped.discard(node.key)

    def drop_node(self, key: bytes) -> None:
        self.nodes.pop(key, None)
        self.used.pop(key, None)
        self.dropped.add(key)

    def put_blob(self, digest: bytes, data: bytes) -> None:
        self.blobs[digest] = data
        self.freed.discard(digest)

    def free_blob(self, digest: bytes) -> None:
        self.blobs.pop(digest, None)
        self.freed.add(digest)

    def put_session(self, leaf: bytes, totals: SessionTotals) -> None:
        self.totals[leaf] = totals
        self.ended.discard(leaf)

    def end_session(self, leaf: bytes) -> None:
        self.totals.pop(leaf, None)
        self.ended.add(leaf)

    def absorb(self, later: _Batch) -> None:
        """Apply ``later`` on top of this batch (used to re-queue a batch that failed to write)."""
        for key in later.dropped:
            self.drop_node(key)
        for node, digest in later.nodes.values():
            self.put_node(node, digest)
        self.used.update(later.used)
        for digest in later.freed:
            self.free_blob(digest)
        for digest, data in later.blobs.items():
            self.put_blob(digest, data)
        for leaf in later.ended:
            self.end_session(leaf)
        for leaf, totals in later.totals.items():
            self.put_session(leaf, totals)


class _Damaged(Exception):
    """The database file is damaged (raised while opening; the file is then moved aside).

    Carries the connection still open: sqlite deletes a database's ``-wal`` when its last
    connection closes, so the files are renamed first and the connection closed after.
    """

    def __init__(self, problem: str, conn: sqlite3.Connection | None = None) -> None:
        super().__init__(problem)
        self.conn = conn

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()


def _is_damage(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(code, int) and (code & 0xFF) in _DAMAGE_CODES


@functools.cache
def _schema_columns() -> dict[str, tuple[str, ...]]:
    """Each table's column names as :data:`_SCHEMA` creates them."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.executescript(_SCHEMA)
        tables = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: tuple(row[1] for row in conn.execute(f"PRAGMA table_info({t})")) for t in tables}
    finally:
        conn.close()


def set_aside(path: Path, now: float) -> Path:
    """Rename ``path`` (and its ``-wal`` / ``-shm`` / ``-journal``) to ``<name>.damaged-<UTC time>``.

    The side files move first: a new database at ``path`` must never meet the old one's WAL.
    """
    stamp = time.strftime(_STAMP, time.gmtime(now))
    target = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while any(Path(f"{target}{suffix}").exists() for suffix in ("", *_SIDE_FILES)):
        n += 1
        target = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    for suffix in (*_SIDE_FILES, ""):
        source = Path(f"{path}{suffix}")
        try:
            os.rename(source, f"{target}{suffix}")
        except FileNotFoundError:
            continue
    return target


@dataclass(slots=True)
class _Loaded:
    """What :meth:`SqliteStore._read_all` found, before it enters the index."""

    nodes: list[tuple[Node, float, bytes]] = field(default_factory=list)
    totals: list[tuple[bytes, SessionTotals]] = field(default_factory=list)
    bad_nodes: list[object] = field(default_factory=list)
    bad_sessions: list[object] = field(default_factory=list)


class SqliteStore(MemoryStore):
    """The embedded default store: memory in front, sqlite behind, written off the event loop.

    ``secret``: when ``None``, read from ``<path>.secret`` (created on first open), so
    tenant roots survive restarts; :meth:`secret` raises :class:`StoreError` before
    :meth:`open`. Like :class:`MemoryStore`, it evicts only when :meth:`evict` is called.
    """

    def __init__(
        self,
        path: str | Path,
        ttl_seconds: float,
        max_bytes: int,
        secret: bytes | None = None,
        flush_interval: float = 0.5,
        clock: Callable[[], float] = time.time,
        *,
        set_aside_damaged: bool = True,
    ) -> None:
        super().__init__(ttl_seconds, max_bytes, secret, clock)
        self.set_aside_damaged = set_aside_damaged
        """Move a damaged file aside and start empty (True), or refuse to open it (False)."""
        self.set_aside: list[Path] = []
        """Where damaged files were moved since this store was created."""
        self._path = Path(path)
        self._secret_given = bool(secret)
        self._flush_interval = flush_interval
        self._conn: sqlite3.Connection | None = None
        self._opened = False
        self._pending = _Batch()
        self._lock = asyncio.Lock()
        self._inflight: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def db_path(self) -> Path:
        return self._path

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self) -> None:
        if self._opened:
            raise StoreError(f"the store {self._path} was opened already (a store opens once)")
        await asyncio.to_thread(self._open_sync)
        self._opened = True
        self._task = asyncio.create_task(self._flush_loop(), name="kvwarm-store-flush")

    async def close(self) -> None:
        if self._conn is None:
            return
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                logger.error("store flush task of %s failed", self._path, exc_info=task.exception())
        try:
            async with self._lock:
                await self._flush_locked()
        finally:
            conn, self._conn = self._conn, None
            if conn is not None:
                await asyncio.to_thread(conn.close)

    async def flush(self) -> None:
        if self._conn is None:
            raise StoreError(f"the store {self._path} is not open")
        async with self._lock:
            await self._flush_locked()

    def secret(self) -> bytes:
        if not self._secret_given and not self._opened:
            raise StoreError(f"the store {self._path} is not open: its secret is not loaded yet")
        return super().secret()

    # -- hooks: every change of the index joins the pending batch -------------------------

    def _on_insert(self, node: Node, digest: bytes, new_blob: bool) -> None:
        self._pending.put_node(node, digest)
        if new_blob:
            self._pending.put_blob(digest, node.body)

    def _on_drop(self, key: bytes, freed_blob: bytes | None) -> None:
        self._pending.drop_node(key)
        if freed_blob is not None:
            self._pending.free_blob(freed_blob)

    def _on_touch(self, key: bytes, now: float) -> None:
        self._pending.used[key] = now

    def _on_totals(self, leaf: bytes, totals: SessionTotals | None) -> None:
        if totals is None:
            self._pending.end_session(leaf)
        else:
            self._pending.put_session(leaf, totals)

    # -- writing --------------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self._flush_interval)
            try:
                await self.flush()
            except StoreError as exc:
                logger.warning("store flush failed, will retry: %s", exc)

    async def _flush_locked(self) -> None:
        # A flush whose caller was cancelled leaves its write running: wait for it, so
        # batches reach the database in order.
        if self._inflight is not None:
            await asyncio.wait({self._inflight})
        batch = self._pending
        if not batch:
            return
        self._pending = _Batch()
        # Snapshot on the loop (the index is not thread-safe); encode and write in the thread.
        used = self._used
        node_rows = [(node, digest, used[key]) for key, (node, digest) in batch.nodes.items()]
        touches = [(t, key) for key, t in batch.used.items() if key not in batch.nodes]
        work = functools.partial(
            self._write_sync,
            node_rows,
            touches,
            list(batch.blobs.items()),
            list(batch.totals.items()),
            [(k,) for k in batch.dropped],
            [(k,) for k in batch.ended],
            [(d,) for d in batch.freed],
        )
        write: asyncio.Future[None] = asyncio.ensure_future(asyncio.to_thread(work))
        self._inflight = write
        write.add_done_callback(functools.partial(self._written, batch))
        await asyncio.wait({write})
        exc = write.exception()
        if isinstance(exc, sqlite3.Error | OSError):
            raise StoreError(f"cannot write to {self._path}: {exc}") from exc
        if exc is not None:
            raise exc

    def _written(self, batch: _Batch, write: asyncio.Future[None]) -> None:
        if self._inflight is write:
            self._inflight = None
        if write.cancelled() or write.exception() is not None:
            batch.absorb(self._pending)
            self._pending = batch

    def _write_sync(
        self,
        node_rows: list[tuple[Node, bytes, float]],
        touches: list[tuple[float, bytes]],
        blobs: list[tuple[bytes, bytes]],
        totals: list[tuple[bytes, SessionTotals]],
        dropped: list[tuple[bytes]],
        ended: list[tuple[bytes]],
        freed: list[tuple[bytes]],
    ) -> None:
        conn = self._conn
        if conn is None:
            raise StoreError(f"the store {self._path} is closed")
        rows = []
        for n, digest, used in node_rows:
            flags = (_GENERATED if n.generated else 0) | (_PARTIAL if n.partial else 0)
            fields_ = (n.key, n.parent, n.tenant, n.depth, n.role, n.identity, digest, n.tokens, flags, n.created)
            try:
                checksum = node_checksum(*fields_)
            except (struct.error, UnicodeEncodeError, TypeError) as exc:
                # One unencodable node must not block every later batch: it stays in memory only.
                logger.warning("store %s: node %s not persisted: %s", self._path, n.key[:8].hex(), exc)
                continue
            rows.append((*fields_, used, checksum))
        sessions = []
        for leaf, t in totals:
            data = encode_totals(t)
            sessions.append((leaf, data, session_checksum(leaf, data)))
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany("DELETE FROM sessions WHERE leaf = ?", ended)
            conn.executemany("DELETE FROM nodes WHERE key = ?", dropped)
            conn.executemany("DELETE FROM blobs WHERE hash = ?", freed)
            conn.executemany("INSERT OR REPLACE INTO blobs (hash, data) VALUES (?, ?)", blobs)
            conn.executemany(f"INSERT OR REPLACE INTO nodes ({_NODE_COLUMNS}) VALUES ({', '.join('?' * 12)})", rows)
            conn.executemany("UPDATE nodes SET used = ? WHERE key = ?", touches)
            conn.executemany("INSERT OR REPLACE INTO sessions (leaf, data, checksum) VALUES (?, ?, ?)", sessions)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            raise

    # -- opening and loading (in a worker thread; nothing else uses the store yet) ---------

    def _open_sync(self) -> None:
        if not self._secret_given:
            self._secret = read_secret(self._path.with_name(self._path.name + ".secret"))
        try:
            self._conn = self._load()
            return
        except _Damaged as exc:
            if not self.set_aside_damaged:
                exc.close()
                raise StoreError(f"cannot load {self._path}: {exc}") from exc
            damage = exc
        try:
            moved = set_aside(self._path, time.time())
        except OSError as exc:
            raise StoreError(f"{self._path} is damaged ({damage}) and cannot be moved aside: {exc.strerror}") from exc
        finally:
            damage.close()
        logger.error(
            "store %s is damaged (%s): moved it aside to %s; starting with an empty store",
            self._path, damage, moved,
        )
        self.set_aside.append(moved)
        # Loading may have filled part of the index before the damage showed: start it afresh.
        corrupt = self._corrupt + 1
        MemoryStore.__init__(self, self._ttl, self._max_bytes, self._secret, self._clock)
        self._corrupt = corrupt
        try:
            self._conn = self._load()
        except _Damaged as exc:
            raise StoreError(f"cannot create a new store at {self._path}: {exc}") from exc

    def _load(self) -> sqlite3.Connection:
        """Connect, check the schema, load every row into the index; the open connection.

        Raises :class:`_Damaged` (holding the connection, still open) when the file is damaged,
        :class:`StoreError` for anything else.
        """
        try:
            conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open {self._path}: {exc}") from exc
        # Text columns come back as bytes: a flipped byte in one must fail that row's
        # decoding, not the whole query.
        conn.text_factory = bytes
        try:
            self._check_tables(conn)  # before anything writes (journal_mode does)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            # Keys are hashes, so inserts land all over the B-trees: with the default 2 MB
            # page cache, a batch's cost grows with the size of the database.
            conn.execute("PRAGMA cache_size = -65536")
            conn.executescript(_SCHEMA)
            conn.execute("INSERT OR IGNORE INTO meta (name, value) VALUES ('schema', ?)", (SCHEMA_VERSION,))
            (version,) = conn.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
            if version != SCHEMA_VERSION.encode():
                raise StoreError(f"{self._path} has schema version {version!r}, expected {SCHEMA_VERSION}")
            loaded = self._read_all(conn)
            self._index(conn, loaded)
        except _Damaged as exc:
            exc.conn = conn
            raise
        except sqlite3.Error as exc:
            if _is_damage(exc):
                raise _Damaged(str(exc), conn) from exc
            conn.close()
            raise StoreError(f"cannot load {self._path}: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def _check_tables(self, conn: sqlite3.Connection) -> None:
        """Refuse another application's database; call a kvwarm store with other columns damaged."""
        present = {
            name.decode() if isinstance(name, bytes) else str(name)
            for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        if not present:
            return
        expected = _schema_columns()
        if "meta" not in present or self._columns(conn, "meta") != expected["meta"]:
            raise StoreError(
                f"{self._path} is a sqlite database of something else (no kvwarm meta table): "
                "refusing to change it; point store.backend at another file"
            )
        for table in present & expected.keys():
            columns = self._columns(conn, table)
            if columns != expected[table]:
                raise _Damaged(f"table {table} has columns {', '.join(columns)}, not the schema's")

    @staticmethod
    def _columns(conn: sqlite3.Connection, table: str) -> tuple[str, ...]:
        return tuple(
            row[1].decode() if isinstance(row[1], bytes) else str(row[1])
            for row in conn.execute(f"PRAGMA table_info({table})")
        )

    def _read_all(self, conn: sqlite3.Connection) -> _Loaded:
        out = _Loaded()
        corrupt = _CorruptLog(self._path)
        blobs: dict[bytes, bytes] = {}
        for digest, data in conn.execute("SELECT hash, data FROM blobs"):
            if isinstance(digest, bytes) and isinstance(data, bytes) and blob_hash(data) == digest:
                blobs[digest] = data
            else:
                corrupt.add("blob", digest, "data does not match its hash")
        for row in conn.execute(f"SELECT {_NODE_COLUMNS} FROM nodes"):
            try:
                out.nodes.append(_decode_node(row, blobs))  # (node, used, digest)
            except CorruptEntry as exc:
                corrupt.add("node", row[0], str(exc))
                out.bad_nodes.append(row[0])
        for leaf, data, checksum in conn.execute("SELECT leaf, data, checksum FROM sessions"):
            try:
                if not isinstance(leaf, bytes) or not isinstance(data, bytes):
                    raise CorruptEntry("columns are not blobs")
                if checksum != session_checksum(leaf, data):
                    raise CorruptEntry("checksum mismatch")
                out.totals.append((leaf, decode_totals(data)))
            except CorruptEntry as exc:
                corrupt.add("session", leaf, str(exc))
                out.bad_sessions.append(leaf)
        corrupt.summarize()
        self._corrupt += corrupt.count
        return out

    def _index(self, conn: sqlite3.Connection, loaded: _Loaded) -> None:
        """Fill the memory index (parents first, children oldest first) and delete what is unusable."""
        loaded.nodes.sort(key=lambda item: (item[0].depth, item[0].created))
        orphans: list[object] = []
        for node, used, digest in loaded.nodes:
            if self._add(node, used, digest=digest, notify=False) is None:
                orphans.append(node.key)
        if orphans:
            logger.info("store %s: dropped %d nodes below missing or corrupt nodes", self._path, len(orphans))
        # Eviction walks ``_used`` in order: rebuild it from the oldest use to the newest.
        self._used = dict(sorted(self._used.items(), key=itemgetter(1)))
        stale: list[object] = []
        loaded.totals.sort(key=lambda item: item[1].updated)
        for leaf, totals in loaded.totals:
            if leaf in self._nodes:
                self._totals[leaf] = totals
            else:
                stale.append(leaf)
        unused = [d for (d,) in conn.execute("SELECT hash FROM blobs") if d not in self._blobs]
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany("DELETE FROM nodes WHERE key = ?", [(k,) for k in loaded.bad_nodes + orphans])
            conn.executemany("DELETE FROM sessions WHERE leaf = ?", [(k,) for k in loaded.bad_sessions + stale])
            conn.executemany("DELETE FROM blobs WHERE hash = ?", [(d,) for d in unused])
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            raise


def _decode_node(row: tuple[Any, ...], blobs: dict[bytes, bytes]) -> tuple[Node, float, bytes]:
    key, parent, tenant, depth, role, identity, body_hash, tokens, flags, created, used, checksum = row
    # Plain ``type() is`` tests: this runs for every row on open.
    if not (
        type(key) is bytes
        and type(parent) is bytes
        and type(tenant) is bytes
        and type(identity) is bytes
        and type(body_hash) is bytes
        and type(checksum) is bytes
        and type(role) is bytes
    ):
        raise CorruptEntry("a column is not a blob")
    if not (type(depth) is int and type(tokens) is int and type(flags) is int):
        raise CorruptEntry("a column is not an integer")
    try:
        role = role.decode()
    except UnicodeDecodeError as exc:
        raise CorruptEntry("the role is not UTF-8") from exc
    if type(created) not in (int, float) or type(used) not in (int, float):
        raise CorruptEntry("a time column is not a number")
    created, used = float(created), float(used)
    try:
        expected = node_checksum(key, parent, tenant, depth, role, identity, body_hash, tokens, flags, created)
    except (struct.error, UnicodeEncodeError) as exc:
        raise CorruptEntry("a column is out of range") from exc
    if checksum != expected:
        raise CorruptEntry("checksum mismatch")
    body = blobs.get(body_hash)
    if body is None:
        raise CorruptEntry("its body blob is missing or corrupt")
    node = Node(
        key=key,
        parent=parent,
        tenant=tenant,
        depth=depth,
        role=role,
        identity=identity,
        body=body,
        tokens=tokens,
        generated=bool(flags & _GENERATED),
        partial=bool(flags & _PARTIAL),
        created=created,
    )
    return node, used, body_hash


class _CorruptLog:
    """Counts corrupt rows and logs them without their content (the first few one by one)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self.count = 0

    def add(self, table: str, key: object, reason: str) -> None:
        self.count += 1
        if self.count <= _LOGGED_CORRUPT:
            shown = key[:8].hex() if isinstance(key, bytes) else type(key).__name__
            logger.warning("store %s: skipped corrupt %s %s: %s", self._path, table, shown, reason)

    def summarize(self) -> None:
        if self.count > _LOGGED_CORRUPT:
            logger.warning("store %s: skipped %d corrupt rows in all", self._path, self.count)
