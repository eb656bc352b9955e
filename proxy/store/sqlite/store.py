"""The ``sqlite`` backend: a :class:`~proxy.store.memory.store.MemoryStore` with write-behind persistence.

Every read is served by the in-memory index, so the request path never touches the
database. The store is made of:

``sqlite_schema``  the file format: tables, rows, checksums
``sqlite_load``    opening a file: the secret, every row verified into the index, damage
``sqlite_flush``   write-behind: changes coalesced into a batch, written in one transaction
                   every ``flush_interval`` seconds, off the event loop

and :class:`SqliteStore` itself: the index's hooks feed the pending batch; a background
task owned by the store (created in :meth:`SqliteStore.open`, cancelled and awaited in
:meth:`SqliteStore.close`) flushes it.

**A damaged file** (see :mod:`proxy.store.sqlite.load`) is moved aside, logged at ERROR,
counted as one entry in ``StoreStats.corrupt`` and listed in :attr:`SqliteStore.set_aside`;
the store then starts empty in a new file. A cache never keeps kvwarm from starting.
Read-only users (``kvwarm sessions``, ``show``, ``export``) pass ``set_aside_damaged=False``:
they may run beside a server and must never move its file, so they refuse it instead.

One process owns a database file.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from ...errors import StoreError
from ..base import Node, SessionTotals
from ..memory.costs import blob_hash
from ..memory.store import MemoryStore
from .flush import WriteBehind
from .load import Damaged, Loader, read_secret, set_aside
from .schema import (
    SCHEMA_VERSION,
    decode_totals,
    encode_totals,
    node_checksum,
    session_checksum,
)

__all__ = [
    "SCHEMA_VERSION",
    "SqliteStore",
    "decode_totals",
    "encode_totals",
    "node_checksum",
    "read_secret",
    "session_checksum",
    "set_aside",
]

logger = logging.getLogger(__name__)


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
        self._opened = False
        self._writer = WriteBehind(self._path, lambda: self._index.used)
        self._task: asyncio.Task[None] | None = None

    @property
    def db_path(self) -> Path:
        return self._path

    @property
    def _conn(self) -> sqlite3.Connection | None:
        return self._writer.conn

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self) -> None:
        if self._opened:
            raise StoreError(f"the store {self._path} was opened already (a store opens once)")
        await asyncio.to_thread(self._open_sync)
        self._opened = True
        self._task = asyncio.create_task(self._writer.run(self._flush_interval), name="kvwarm-store-flush")

    async def close(self) -> None:
        if self._writer.conn is None:
            return
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                logger.error("store flush task of %s failed", self._path, exc_info=task.exception())
        await self._writer.close()

    async def flush(self) -> None:
        await self._writer.flush()

    def secret(self) -> bytes:
        if not self._secret_given and not self._opened:
            raise StoreError(f"the store {self._path} is not open: its secret is not loaded yet")
        return super().secret()

    # -- hooks: every change of the index joins the pending batch -------------------------

    def _on_insert(self, node: Node, digest: bytes, new_blob: bool) -> None:
        pending = self._writer.pending
        pending.put_node(node, digest)
        if new_blob:
            pending.put_blob(digest, node.body)

    def _on_drop(self, key: bytes, freed_blob: bytes | None) -> None:
        pending = self._writer.pending
        pending.drop_node(key)
        if freed_blob is not None:
            pending.free_blob(freed_blob)

    def _on_touch(self, key: bytes, now: float) -> None:
        self._writer.pending.used[key] = now

    def _on_tokens(self, key: bytes, tokens: int) -> None:
        node = self._index.nodes.get(key)
        if node is not None:  # the node's row again, with its count
            self._writer.pending.put_node(node, blob_hash(node.body))

    def _on_totals(self, leaf: bytes, totals: SessionTotals | None) -> None:
        if totals is None:
            self._writer.pending.end_session(leaf)
        else:
            self._writer.pending.put_session(leaf, totals)

    # -- opening (in a worker thread; nothing else uses the store yet) --------------------

    def _open_sync(self) -> None:
        if not self._secret_given:
            self._secret = read_secret(self._path.with_name(self._path.name + ".secret"))
        try:
            self._writer.conn = self._load()
            return
        except Damaged as exc:
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
            self._writer.conn = self._load()
        except Damaged as exc:
            raise StoreError(f"cannot create a new store at {self._path}: {exc}") from exc

    def _load(self) -> sqlite3.Connection:
        """The file loaded into the index (its corrupt rows counted, even when it is damaged)."""
        loader = Loader(self._path, self)
        try:
            return loader.load()
        finally:
            self._corrupt += loader.corrupt
