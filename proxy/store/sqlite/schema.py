"""The sqlite store's file format: its tables, how a node or a session becomes a row, and the rows' checksums.

Schema (version 1)::

    meta     (name TEXT PRIMARY KEY, value TEXT)            schema version
    blobs    (hash BLOB PRIMARY KEY, data BLOB)             bodies by blake2b-256 of data
    nodes    (key BLOB PRIMARY KEY, parent, tenant, depth, role, identity,
              body_hash, tokens, flags, created, used, checksum)
    sessions (leaf BLOB PRIMARY KEY, data BLOB, checksum)   SessionTotals as JSON

``nodes.checksum`` is a keyed blake2b of every column except ``used`` (which changes
on each touch); ``sessions.checksum`` covers the leaf and the JSON. Decoding a row
raises :class:`~proxy.errors.CorruptEntry` on anything that does not decode or verify.
"""

from __future__ import annotations

import functools
import hashlib
import sqlite3
import struct
from dataclasses import fields
from typing import Any

import orjson

from ...core.model import Node, SessionTotals
from ...errors import CorruptEntry

__all__ = [
    "NODE_COLUMNS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "decode_node",
    "decode_totals",
    "encode_totals",
    "node_checksum",
    "node_fields",
    "schema_columns",
    "session_checksum",
    "table_columns",
]

SCHEMA_VERSION = "1"

SCHEMA = """
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

NODE_COLUMNS = "key, parent, tenant, depth, role, identity, body_hash, tokens, flags, created, used, checksum"

_GENERATED = 1
_PARTIAL = 2
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


def node_fields(node: Node, digest: bytes) -> tuple[bytes, bytes, bytes, int, str, bytes, bytes, int, int, float]:
    """The checksummed columns of ``node``'s row (its body being blob ``digest``)."""
    flags = (_GENERATED if node.generated else 0) | (_PARTIAL if node.partial else 0)
    return (node.key, node.parent, node.tenant, node.depth, node.role, node.identity, digest, node.tokens, flags, node.created)


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


def decode_node(row: tuple[Any, ...], blobs: dict[bytes, bytes]) -> tuple[Node, float, bytes]:
    """A ``nodes`` row (:data:`NODE_COLUMNS`, text as bytes) with its body from ``blobs``:
    (node, last use, body hash). Raises :class:`CorruptEntry`."""
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


@functools.cache
def schema_columns() -> dict[str, tuple[str, ...]]:
    """Each table's column names as :data:`SCHEMA` creates them."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.executescript(SCHEMA)
        tables = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: tuple(row[1] for row in conn.execute(f"PRAGMA table_info({t})")) for t in tables}
    finally:
        conn.close()


def table_columns(conn: sqlite3.Connection, table: str) -> tuple[str, ...]:
    """The column names of ``table`` in an open database (text may come back as bytes)."""
    return tuple(
        row[1].decode() if isinstance(row[1], bytes) else str(row[1])
        for row in conn.execute(f"PRAGMA table_info({table})")
    )
