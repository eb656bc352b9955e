"""Write-behind for the sqlite store: changes coalesced into a pending batch, written off the event loop.

The memory index reports every change through its hooks; :class:`Batch` keeps only the
latest state per key. :meth:`WriteBehind.flush` swaps the batch for an empty one and
writes it in one transaction through ``asyncio.to_thread`` on the store's one connection
(WAL, ``synchronous=NORMAL``). Batches reach the database in order: a flush waits for the
write of the previous one, even when that flush's caller was cancelled. A batch that fails
to write goes back under the changes made since, and is written with them next time.

The memory index is the arbiter of insert-if-absent (the first node wins there), so the
database mirrors it with ``INSERT OR REPLACE``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ...core.model import Node, SessionTotals
from ...errors import StoreError
from .schema import NODE_COLUMNS, encode_totals, node_checksum, node_fields, session_checksum

__all__ = ["Batch", "WriteBehind"]

logger = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class Batch:
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

    def absorb(self, later: Batch) -> None:
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


@dataclass(frozen=True, slots=True, kw_only=True)
class _Rows:
    """One batch as the rows and keys its transaction writes (encoded in the worker thread)."""

    nodes: list[tuple[Node, bytes, float]]
    touches: list[tuple[float, bytes]]
    blobs: list[tuple[bytes, bytes]]
    totals: list[tuple[bytes, SessionTotals]]
    dropped: list[tuple[bytes]]
    ended: list[tuple[bytes]]
    freed: list[tuple[bytes]]


class WriteBehind:
    """The pending batch of one sqlite store and its writes, in order, on ``conn``.

    ``used`` reads the index's last-use table when a batch is taken (nodes are written with it).
    """

    def __init__(self, path: Path, used: Callable[[], Mapping[bytes, float]]) -> None:
        self.path = path
        self.conn: sqlite3.Connection | None = None
        """The store's connection (set once the file is loaded; None once closed)."""
        self.pending = Batch()
        self._used = used
        self._lock = asyncio.Lock()
        self._inflight: asyncio.Future[None] | None = None

    async def run(self, interval: float) -> None:
        """Flush every ``interval`` seconds until cancelled; a failed flush is retried next time."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.flush()
            except StoreError as exc:
                logger.warning("store flush failed, will retry: %s", exc)

    async def flush(self) -> None:
        """Write the pending batch now (after the write of the batch before it)."""
        if self.conn is None:
            raise StoreError(f"the store {self.path} is not open")
        async with self._lock:
            await self._flush_locked()

    async def close(self) -> None:
        """Write what is pending, then close the connection (even when that write fails)."""
        try:
            async with self._lock:
                await self._flush_locked()
        finally:
            conn, self.conn = self.conn, None
            if conn is not None:
                await asyncio.to_thread(conn.close)

    async def _flush_locked(self) -> None:
        # A flush whose caller was cancelled leaves its write running: wait for it, so
        # batches reach the database in order.
        if self._inflight is not None:
            await asyncio.wait({self._inflight})
        batch = self.pending
        if not batch:
            return
        self.pending = Batch()
        # Snapshot on the loop (the index is not thread-safe); encode and write in the thread.
        used = self._used()
        rows = _Rows(
            nodes=[(node, digest, used[key]) for key, (node, digest) in batch.nodes.items()],
            touches=[(t, key) for key, t in batch.used.items() if key not in batch.nodes],
            blobs=list(batch.blobs.items()),
            totals=list(batch.totals.items()),
            dropped=[(k,) for k in batch.dropped],
            ended=[(k,) for k in batch.ended],
            freed=[(d,) for d in batch.freed],
        )
        write: asyncio.Future[None] = asyncio.ensure_future(asyncio.to_thread(self._write_sync, rows))
        self._inflight = write
        write.add_done_callback(functools.partial(self._written, batch))
        await asyncio.wait({write})
        exc = write.exception()
        if isinstance(exc, sqlite3.Error | OSError):
            raise StoreError(f"cannot write to {self.path}: {exc}") from exc
        if exc is not None:
            raise exc

    def _written(self, batch: Batch, write: asyncio.Future[None]) -> None:
        if self._inflight is write:
            self._inflight = None
        if write.cancelled() or write.exception() is not None:
            batch.absorb(self.pending)
            self.pending = batch

    def _write_sync(self, rows: _Rows) -> None:
        conn = self.conn
        if conn is None:
            raise StoreError(f"the store {self.path} is closed")
        nodes = []
        for n, digest, used in rows.nodes:
            fields_ = node_fields(n, digest)
            try:
                checksum = node_checksum(*fields_)
            except (struct.error, UnicodeEncodeError, TypeError) as exc:
                # One unencodable node must not block every later batch: it stays in memory only.
                logger.warning("store %s: node %s not persisted: %s", self.path, n.key[:8].hex(), exc)
                continue
            nodes.append((*fields_, used, checksum))
        sessions = []
        for leaf, t in rows.totals:
            data = encode_totals(t)
            sessions.append((leaf, data, session_checksum(leaf, data)))
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany("DELETE FROM sessions WHERE leaf = ?", rows.ended)
            conn.executemany("DELETE FROM nodes WHERE key = ?", rows.dropped)
            conn.executemany("DELETE FROM blobs WHERE hash = ?", rows.freed)
            conn.executemany("INSERT OR REPLACE INTO blobs (hash, data) VALUES (?, ?)", rows.blobs)
            conn.executemany(f"INSERT OR REPLACE INTO nodes ({NODE_COLUMNS}) VALUES ({', '.join('?' * 12)})", nodes)
            conn.executemany("UPDATE nodes SET used = ? WHERE key = ?", rows.touches)
            conn.executemany("INSERT OR REPLACE INTO sessions (leaf, data, checksum) VALUES (?, ?, ?)", sessions)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            raise
