"""Opening a sqlite store's file: its secret, the schema check, every row read and verified into the memory index, and damage.

Runs in a worker thread, before anything else uses the store.

**Rows.** On open, a blob whose data does not hash to its key, a node whose columns do
not decode or verify (:mod:`proxy.store.sqlite.schema`) or whose blob is missing, and a
session that does not decode are skipped, logged (never their content) and counted;
nodes below a skipped node are unreachable and are dropped like them. Skipped rows are
deleted, so a later request can store the same key again.

**Damage.** A damaged file -- sqlite reports it corrupt or not a database while it is
opened and read, or a kvwarm table has other columns than the schema's -- raises
:class:`Damaged`; the store then moves it aside with :func:`set_aside`
(``<name>.damaged-<UTC time>``, with its ``-wal``, ``-shm`` and ``-journal`` files under
the same new name, so sqlite can still open the copy for forensics). Not damage, but
refused with :class:`~proxy.errors.StoreError`: a file of another schema version (a newer
kvwarm's store), a sqlite database of another application (tables, but no kvwarm
``meta``), and errors such as permissions or a lock held by another process.

**Secret.** ``<path>.secret`` keeps the tenant-hash secret across restarts
(:func:`read_secret`).
"""

from __future__ import annotations

import logging
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...core.model import Node, SessionTotals
from ...errors import CorruptEntry, StoreError
from ..memory.store import MemoryStore, blob_hash
from .schema import (
    NODE_COLUMNS,
    SCHEMA,
    SCHEMA_VERSION,
    decode_node,
    decode_totals,
    schema_columns,
    session_checksum,
    table_columns,
)

__all__ = ["SECRET_SIZE", "Damaged", "Loader", "read_secret", "set_aside"]

logger = logging.getLogger(__name__)

SECRET_SIZE = 32
_LOGGED_CORRUPT = 20
"""Corrupt rows logged one by one on open; the rest are summed up in one line."""
_DAMAGE_CODES = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})
"""Primary sqlite result codes that mean the file itself is damaged (not locked, not unreadable)."""
_SIDE_FILES = ("-wal", "-shm", "-journal")
_STAMP = "%Y%m%dT%H%M%SZ"


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


class Damaged(Exception):
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


@dataclass(slots=True, kw_only=True)
class _Loaded:
    """What :meth:`Loader._read_all` found, before it enters the index."""

    nodes: list[tuple[Node, float, bytes]] = field(default_factory=list)
    totals: list[tuple[bytes, SessionTotals]] = field(default_factory=list)
    bad_nodes: list[object] = field(default_factory=list)
    bad_sessions: list[object] = field(default_factory=list)


class Loader:
    """Loads the database at ``path`` into ``store``'s (empty) index."""

    def __init__(self, path: Path, store: MemoryStore) -> None:
        self.path = path
        self.store = store
        self.corrupt = 0
        """Rows skipped as corrupt (each one a counted miss)."""

    def load(self) -> sqlite3.Connection:
        """Connect, check the schema, load every row into the index; the open connection.

        Raises :class:`Damaged` (holding the connection, still open) when the file is damaged,
        :class:`StoreError` for anything else.
        """
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open {self.path}: {exc}") from exc
        # Text columns come back as bytes: a flipped byte in one must fail that row's
        # decoding, not the whole query.
        conn.text_factory = bytes
        try:
            self._prepare(conn)
            self._index(conn, self._read_all(conn))
        except Damaged as exc:
            exc.conn = conn
            raise
        except sqlite3.Error as exc:
            if _is_damage(exc):
                raise Damaged(str(exc), conn) from exc
            conn.close()
            raise StoreError(f"cannot load {self.path}: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def _prepare(self, conn: sqlite3.Connection) -> None:
        self._check_tables(conn)  # before anything writes (journal_mode does)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        # Keys are hashes, so inserts land all over the B-trees: with the default 2 MB
        # page cache, a batch's cost grows with the size of the database.
        conn.execute("PRAGMA cache_size = -65536")
        conn.executescript(SCHEMA)
        conn.execute("INSERT OR IGNORE INTO meta (name, value) VALUES ('schema', ?)", (SCHEMA_VERSION,))
        (version,) = conn.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
        if version != SCHEMA_VERSION.encode():
            raise StoreError(f"{self.path} has schema version {version!r}, expected {SCHEMA_VERSION}")

    def _check_tables(self, conn: sqlite3.Connection) -> None:
        """Refuse another application's database; call a kvwarm store with other columns damaged."""
        present = {
            name.decode() if isinstance(name, bytes) else str(name)
            for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        if not present:
            return
        expected = schema_columns()
        if "meta" not in present or table_columns(conn, "meta") != expected["meta"]:
            raise StoreError(
                f"{self.path} is a sqlite database of something else (no kvwarm meta table): "
                "refusing to change it; point store.backend at another file"
            )
        for table in present & expected.keys():
            columns = table_columns(conn, table)
            if columns != expected[table]:
                raise Damaged(f"table {table} has columns {', '.join(columns)}, not the schema's")

    def _read_all(self, conn: sqlite3.Connection) -> _Loaded:
        out = _Loaded()
        corrupt = _CorruptLog(self.path)
        blobs: dict[bytes, bytes] = {}
        for digest, data in conn.execute("SELECT hash, data FROM blobs"):
            if isinstance(digest, bytes) and isinstance(data, bytes) and blob_hash(data) == digest:
                blobs[digest] = data
            else:
                corrupt.add("blob", digest, "data does not match its hash")
        for row in conn.execute(f"SELECT {NODE_COLUMNS} FROM nodes"):
            try:
                out.nodes.append(decode_node(row, blobs))  # (node, used, digest)
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
        self.corrupt += corrupt.count
        return out

    def _index(self, conn: sqlite3.Connection, loaded: _Loaded) -> None:
        """Fill the memory index (parents first, children oldest first) and delete what is unusable."""
        store = self.store
        loaded.nodes.sort(key=lambda item: (item[0].depth, item[0].created))
        orphans: list[object] = [
            node.key for node, used, digest in loaded.nodes if not store._load_node(node, used, digest)
        ]
        if orphans:
            logger.info("store %s: dropped %d nodes below missing or corrupt nodes", self.path, len(orphans))
        loaded.totals.sort(key=lambda item: item[1].updated)
        stale: list[object] = [leaf for leaf, totals in loaded.totals if not store._load_totals(leaf, totals)]
        unused = [d for (d,) in conn.execute("SELECT hash FROM blobs") if d not in store._blobs]
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
