"""Which replica served a prefix: the affinity table, keyed by node key.

A node key is a tenant-rooted chain hash, so it names a whole prefix (see
:mod:`proxy.core.model`); the replica that served a request holds the KV of the
request's prefix. After each answered turn the router remembers the turn's keys
past its matched prefix, and the deepest matched one (so a session that moved
moves its home). To place the next request it looks its matched keys up, deepest
first: the first one found is the session's home.

Because keys are *repaired* identities, a drifting agent's keys do not change
from turn to turn and it keeps its home; routers that hash the raw bytes lose it.

:class:`Affinity` is the seam: :class:`LocalAffinity` keeps a bounded LRU table in this
process. A shared store keeps it beside the transcripts (an :class:`AffinitySource`: the
Redis store, :mod:`proxy.store.redis.affinity`), so every kvwarm process in front of the
same pool sees where a session lives: one entry per node key, kept with the tenant's other
keys (``tenant``), expiring about when an engine's KV would
(``routing.affinity_ttl_seconds``: minutes to hours, not the transcript's day), returned by
the store's fill of the same chain in the same round trip (else one ``MGET``) and written
with one pipelined ``SET ... PX``. Replicas are named by their base URL, which every process
configured with the same pool agrees on. :func:`affinity_for` picks the table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ..config import RoutingSettings

__all__ = ["Affinity", "AffinitySource", "LocalAffinity", "affinity_for"]


class Affinity(Protocol):
    """Node key -> the replica (its base URL) that last served that prefix.

    Never raises on the request path: an implementation whose backing store fails or is
    slow answers None (a miss: the request is placed as a new session) and counts it."""

    async def lookup(self, tenant: bytes, keys: Sequence[bytes]) -> str | None:
        """The replica of the first of ``keys`` (deepest first) that has one. ``tenant`` is the
        keys' tenant root (a shared store keeps a tenant's entries together, as its nodes)."""
        ...

    async def remember(self, tenant: bytes, keys: Sequence[bytes], replica: str) -> None:
        """``replica`` served (and now holds the KV of) every prefix in ``keys``."""
        ...


class LocalAffinity:
    """In-process, at most ``max_entries`` keys; the least recently used go first."""

    __slots__ = ("_table", "max_entries")

    def __init__(self, max_entries: int = 65536) -> None:
        self.max_entries = max(1, max_entries)
        self._table: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    async def lookup(self, tenant: bytes, keys: Sequence[bytes]) -> str | None:
        # Keys are tenant-rooted already: one table serves every tenant.
        table = self._table
        for key in keys:
            replica = table.get(key)
            if replica is not None:
                table.move_to_end(key)
                return replica
        return None

    async def remember(self, tenant: bytes, keys: Sequence[bytes], replica: str) -> None:
        table = self._table
        for key in keys:
            table[key] = replica
            table.move_to_end(key)
        while len(table) > self.max_entries:
            table.popitem(last=False)


@runtime_checkable
class AffinitySource(Protocol):
    """A store that can keep the affinity table beside its transcripts."""

    shared: bool
    """True when other processes use the same store (then so do their routers)."""

    def affinity(self, ttl_seconds: float) -> Affinity:
        """The table in this store; an entry expires ``ttl_seconds`` after its last write."""
        ...


def affinity_for(store: object, settings: RoutingSettings, replicas: int) -> Affinity:
    """The affinity table of a router over ``replicas`` upstreams in front of ``store``: the
    store's own when it is shared (and affinity is used at all: a pool, the ``prefix``
    policy), so every process routes a session the same way; else one in this process."""
    if replicas > 1 and settings.policy == "prefix" and isinstance(store, AffinitySource) and store.shared:
        return store.affinity(settings.affinity_ttl_seconds)
    return LocalAffinity(settings.affinity_entries)
