"""Routing affinity kept in the Redis store: which replica served a prefix, the same answer in every kvwarm process.

:class:`RedisAffinity` implements the router's :class:`~proxy.routing.affinity.Affinity`
seam beside the shared transcripts, so that with several kvwarm replicas behind a load
balancer every one of them sends a session to the replica that holds its KV.

**Keys.** One per node key, ``P:{T}:r:<key>`` -> the replica's base URL (which every process
configured with the same pool agrees on), in the tenant's hash tag like the tenant's nodes,
with its own short TTL (``routing.affinity_ttl_seconds``: about as long as an engine keeps
KV, minutes to hours, not the transcript's day).

**Reads.** The store's fill of a request walks the request's chain anyway; it brings the
entries of the chain's :data:`PREFETCH_DEPTH` deepest present keys in the same script call
(:mod:`proxy.store.redis.reads`), and they are kept here for :data:`PREFETCH_SECONDS`, so the
router's look-up moments later needs no round trip. A key no fill covered is read with one
``MGET`` (all of the tenant's keys are in one slot).

**Writes.** :meth:`RedisAffinity.remember` is one pipelined ``SET ... PX`` per key, right
after the turn's write (the router remembers once the turn is recorded); the entries are
kept here too, so this process sees them at once.

**Failure.** Neither call raises: Redis down (the store's breaker refuses at once) or slow
(the store's timeout) is a counted miss, and the router places the request as a new session
-- by rendezvous hashing, which every process computes alike. Bounded load stays per
process: only where a session lives is shared.
"""

from __future__ import annotations

import time
from binascii import Error as HexError
from binascii import unhexlify
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...errors import StoreError
from .layout import KeyLayout
from .link import RedisLink

__all__ = ["PREFETCH_DEPTH", "PREFETCH_ENTRIES", "PREFETCH_SECONDS", "AffinityCounters", "RedisAffinity"]

PREFETCH_DEPTH = 66
"""Deepest present chain keys whose entries a fill brings: a little over the router's look-up
(the deepest matched key and 64 above it)."""
PREFETCH_SECONDS = 2.0
"""How long an entry read (or written) here answers a look-up without asking Redis: the
moments between a request's fill and its placement, and a failover's second placement."""
PREFETCH_ENTRIES = 16384
"""Entries kept here at most (the oldest go first)."""


@dataclass(slots=True, kw_only=True)
class AffinityCounters:
    """Cheap local counters of one :class:`RedisAffinity`."""

    found: int = 0
    """Look-ups that named a replica."""
    missed: int = 0
    """Look-ups that named none (a new session, expired entries, or an error)."""
    prefetched: int = 0
    """Look-ups answered by what a fill brought (or this process wrote): no round trip."""
    fetched: int = 0
    """Look-ups that needed a round trip of their own."""
    remembered: int = 0
    """Keys written."""
    errors: int = 0
    """Look-ups or writes that failed (Redis down or slow): each a miss."""


class RedisAffinity:
    """Node key -> replica base URL in Redis, ``ttl_seconds`` after it was last written."""

    def __init__(
        self, link: RedisLink, layout: KeyLayout, ttl_seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not ttl_seconds > 0:
            raise ValueError("the affinity TTL must be positive")
        self.counters = AffinityCounters()
        self._link = link
        self._layout = layout
        self._ttl_ms = max(1, round(ttl_seconds * 1000))
        self._clock = clock
        self._known: OrderedDict[bytes, tuple[str | None, float]] = OrderedDict()
        """key -> (replica or None: none, when it was read or written)."""

    async def lookup(self, tenant: bytes, keys: Sequence[bytes]) -> str | None:
        """The replica of the first of ``keys`` (deepest first) that has one."""
        if not tenant:  # no tenant named (the secret is unknown): nothing is kept under it
            return self._answer(None, prefetched=True)
        now = self._clock()
        for i, key in enumerate(keys):
            entry = self._known.get(key)
            if entry is None or now - entry[1] > PREFETCH_SECONDS:
                return await self._fetch(tenant, keys[i:], now)
            if entry[0] is not None:
                return self._answer(entry[0], prefetched=True)
        return self._answer(None, prefetched=True)

    async def remember(self, tenant: bytes, keys: Sequence[bytes], replica: str) -> None:
        """``replica`` served every prefix in ``keys``: one pipelined write, never an error."""
        if not keys or not tenant:
            return
        now = self._clock()
        for key in keys:
            self._keep(key, replica, now)
        value = replica.encode()
        ops = [("SET", self._layout.affinity(tenant, k), value, "PX", self._ttl_ms) for k in keys]
        try:
            await self._link.run("affinity", ops)
        except StoreError:
            self.counters.errors += 1
            return
        self.counters.remembered += len(keys)

    def prefetched(self, routes: Sequence[bytes]) -> None:
        """Entries a fill brought: ``[hex key, replica or b"", ...]``."""
        now = self._clock()
        for i in range(0, len(routes) - 1, 2):
            try:
                key = unhexlify(routes[i])
            except (HexError, ValueError):
                continue
            self._keep(key, _replica(routes[i + 1]), now)

    async def _fetch(self, tenant: bytes, keys: Sequence[bytes], now: float) -> str | None:
        self.counters.fetched += 1
        names = [self._layout.affinity(tenant, k) for k in keys]
        try:
            values = await self._link.guarded("affinity", lambda c: c.execute_command("MGET", *names))
        except StoreError:
            self.counters.errors += 1
            return self._answer(None, prefetched=False)
        found = None
        for key, value in zip(keys, values, strict=False):
            replica = _replica(value)
            self._keep(key, replica, now)
            if replica is not None and found is None:
                found = replica
        return self._answer(found, prefetched=False)

    def _answer(self, replica: str | None, *, prefetched: bool) -> str | None:
        counters = self.counters
        if prefetched:
            counters.prefetched += 1
        if replica is None:
            counters.missed += 1
        else:
            counters.found += 1
        return replica

    def _keep(self, key: bytes, replica: str | None, now: float) -> None:
        known = self._known
        known[key] = (replica, now)
        known.move_to_end(key)
        if len(known) > PREFETCH_ENTRIES:
            known.popitem(last=False)


def _replica(value: object) -> str | None:
    """A stored base URL, or None (absent, empty, or not text: a miss)."""
    if not isinstance(value, bytes) or not value:
        return None
    try:
        return value.decode()
    except UnicodeDecodeError:
        return None
