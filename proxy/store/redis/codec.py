"""The Redis store's values: a node's record, session totals as hash fields, and a script's reply decoded into verified nodes.

**Record** (``P:{T}:n:<key>``): a fixed header -- parent, identity and body hash in hex
(the scripts build key names from them and read them by offset without decoding: parent
1..32, identity 33..64, body hash 65..128), flags (129), depth (130..133), tokens, created,
role length -- then the role, then the body when it is at most :data:`INLINE_MAX` bytes;
a longer body is a blob of its own (``P:{T}:b:<hash>``).

**Verification.** A decoded record must chain to its key (``chain(parent, identity)``, a
depth-0 node under its tenant root) and a blob must hash to its name; anything else is
counted corrupt and read as a miss, never a partial transcript. A node already in the
process cache is taken from there (interned body, no decoding).

**Totals** travel as the hash fields :data:`TOTALS_FIELDS`, in that order, as strings.
"""

from __future__ import annotations

import struct
import sys
from binascii import unhexlify
from collections.abc import Sequence
from typing import Any

from ...core.model import Node, SessionTotals, chain
from ..memory.costs import blob_hash
from .cache import NodeCache, RedisCounters

__all__ = [
    "INLINE_MAX",
    "RECORD_HEAD",
    "TOTALS_FIELDS",
    "ReplyDecoder",
    "encode_node",
    "encoded",
    "normalized",
    "totals_of",
    "turn_fields",
]

INLINE_MAX = 1024
"""Bodies up to this many bytes live in the node record; longer ones in a shared blob key."""

_HEAD = struct.Struct(">32s32s64sBIIdH")
"""Record header: parent, identity and body hash (in hex: the scripts build key names from
them), flags, depth, tokens, created, role length; then the role, then an inline body."""
_GENERATED, _PARTIAL, _INLINE = 1, 2, 4
RECORD_HEAD = _HEAD.size
"""Bytes of a record's fixed header: a shorter record is damage (the scripts read it by offset)."""

TOTALS_FIELDS = (
    "turns",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "unknown_cache_turns",
    "cost_usd",
    "billed",
    "repaired",
    "last_break",
    "model",
    "created",
    "updated",
)
"""Session totals fields, in the order the scripts send and return them."""


def encode_node(node: Node, digest: bytes) -> tuple[bytes, bytes]:
    """The node's record and, for a body over :data:`INLINE_MAX`, the body to store as a blob."""
    inline = len(node.body) <= INLINE_MAX
    flags = (_GENERATED if node.generated else 0) | (_PARTIAL if node.partial else 0) | (_INLINE if inline else 0)
    role = node.role.encode("utf-8", "surrogatepass")
    head = _HEAD.pack(
        node.parent.hex().encode(),
        node.identity.hex().encode(),
        digest.hex().encode(),
        flags,
        node.depth,
        node.tokens,
        node.created,
        len(role),
    )
    if inline:
        return head + role + node.body, b""
    return head + role, node.body


def encoded(node: Node) -> tuple[bytes, bytes, bytes]:
    """``(body hash, record, blob body or b"")`` of ``node``."""
    digest = blob_hash(node.body)
    record, body = encode_node(node, digest)
    return digest, record, body


class ReplyDecoder:
    """Nodes out of a script's reply (records and blobs), verified, interned in the process cache."""

    __slots__ = ("_cache", "_counters")

    def __init__(self, cache: NodeCache, counters: RedisCounters) -> None:
        self._cache = cache
        self._counters = counters

    def nodes(self, tenant: bytes, recs: Sequence[bytes], blobs: Sequence[bytes]) -> dict[bytes, Node]:
        """Nodes of a reply, by hex key; corrupt records are counted and left out."""
        bodies = {blobs[i]: blobs[i + 1] for i in range(0, len(blobs), 2)}
        out: dict[bytes, Node] = {}
        for i in range(0, len(recs), 2):
            hexkey = recs[i]
            node = self.node(tenant, hexkey, recs[i + 1], bodies)
            if node is not None:
                out[hexkey] = node
        return out

    def node(self, tenant: bytes, hexkey: bytes, rec: bytes, bodies: dict[bytes, bytes]) -> Node | None:
        """One record (its blob, if any, among ``bodies`` by hex hash); None: corrupt or a miss."""
        cache = self._cache
        try:
            key = unhexlify(hexkey)
            cached = cache.get(key)
            if cached is not None:
                return cached
            hparent, hidentity, hdigest, flags, depth, tokens, created, role_len = _HEAD.unpack_from(rec)
            parent, identity, digest = unhexlify(hparent), unhexlify(hidentity), unhexlify(hdigest)
            end = _HEAD.size + role_len
            role = sys.intern(rec[_HEAD.size : end].decode("utf-8", "surrogatepass"))
        except (struct.error, UnicodeDecodeError, ValueError):
            self._counters.corrupt += 1
            return None
        if chain(parent, identity) != key or (depth == 0 and parent != tenant):
            self._counters.corrupt += 1
            return None
        body: bytes | None
        if flags & _INLINE:
            body = rec[end:]  # as sound as the record it is part of
        else:
            body = cache.blob(digest)
            if body is None:
                body = bodies.get(hdigest)
                if body is None:
                    return None  # the blob expired or was evicted: a miss
                if blob_hash(body) != digest:
                    self._counters.corrupt += 1
                    return None
        node = Node(
            key=key, parent=parent, tenant=tenant, depth=depth, role=role, identity=identity, body=body,
            tokens=tokens, generated=bool(flags & _GENERATED), partial=bool(flags & _PARTIAL), created=created,
        )
        return cache.put(node, digest)


def normalized(totals: SessionTotals, now: float) -> SessionTotals:
    """A turn as ``add_turn`` counts it: at least one turn, updated now unless stamped."""
    return SessionTotals(
        turns=max(totals.turns, 1),
        prompt_tokens=totals.prompt_tokens,
        cached_tokens=totals.cached_tokens,
        completion_tokens=totals.completion_tokens,
        unknown_cache_turns=totals.unknown_cache_turns,
        cost_usd=totals.cost_usd,
        billed=totals.billed,
        repaired=totals.repaired,
        last_break=totals.last_break,
        model=totals.model,
        created=totals.created,
        updated=totals.updated or now,
    )


def turn_fields(t: SessionTotals) -> list[str]:
    """``t`` as the write script reads a turn: :data:`TOTALS_FIELDS`, in order."""
    return [
        str(t.turns),
        str(t.prompt_tokens),
        str(t.cached_tokens),
        str(t.completion_tokens),
        str(t.unknown_cache_turns),
        repr(float(t.cost_usd)),
        "1" if t.billed else "0",
        str(t.repaired),
        t.last_break,
        t.model,
        repr(float(t.created)),
        repr(float(t.updated)),
    ]


def totals_of(values: Sequence[Any]) -> SessionTotals:
    """Totals from :data:`TOTALS_FIELDS` values as Redis returns them."""
    v = [x.decode("utf-8", "surrogatepass") if isinstance(x, bytes) else str(x) for x in values]
    return SessionTotals(
        turns=int(v[0]),
        prompt_tokens=int(v[1]),
        cached_tokens=int(v[2]),
        completion_tokens=int(v[3]),
        unknown_cache_turns=int(v[4]),
        cost_usd=float(v[5]),
        billed=v[6] == "1",
        repaired=int(v[7]),
        last_break=v[8],
        model=v[9],
        created=float(v[10]),
        updated=float(v[11]),
    )
