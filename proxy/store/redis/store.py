"""The Redis transcript store: one tree shared by every kvwarm process and replica.

:class:`RedisStore` implements :class:`~proxy.store.base.AsyncStore` on Redis (or a
Redis Cluster) through redis-py's asyncio client (hiredis parser). Every process reads
and writes the same tree, so a session whose turns a load balancer spreads over
replicas is matched -- and repaired -- whole on each of them. It can also keep the
router's affinity table (:meth:`RedisStore.affinity`), so every process sends a session
to the same replica of the upstream pool.

**URLs** (``store.backend``)::

    redis://[[user]:password@]host:port[/db]      plain TCP (redis-py ``from_url``)
    rediss://...                                  TLS
    unix:///path/to/redis.sock[?db=N]             a Unix socket
    redis+cluster://[[user]:password@]host:port[,host:port...]
    rediss+cluster://...                          Redis Cluster (TLS): the listed nodes are
                                                  only where discovery starts

"Cluster" is said by the scheme (``+cluster``), not a query flag: a cluster client speaks
another protocol (MOVED/ASK redirections, slot routing) and cannot use ``db`` or a socket.

The store is made of, one concept each:

``link``      the connection: every call bounded, the breaker, the probe
``secret``    the shared secret (agreed again with Redis while running)
``layout``    the key layout (one hash tag per tenant) and what it costs in a cluster
``codec``     node records and session totals as Redis holds them; verified decoding
``scripts``   the Lua scripts: fill, path, sessions, write
``cache``     the per-process cache of immutable nodes, and the counters
``view``      one request's read view
``reads``     the fill: a request's lookups in one round trip
``writes``    a turn's write in one round trip: insert-if-absent, touch, totals, heal
``admin``     a session's path and totals, session lists
``affinity``  the router's affinity table beside the transcripts

**Memory and expiry.** Every key of a tenant carries the sliding TTL (``ttl_seconds``),
refreshed by each turn's write (:mod:`proxy.store.redis.writes`). Memory is bounded by
Redis itself: set ``maxmemory`` and ``maxmemory-policy volatile-ttl``. With sliding TTLs
the key nearest to expiry is the one used longest ago, so ``volatile-ttl`` evicts in
kvwarm's own LRU order, and it never evicts ``P:secret`` (which has no TTL): under
``allkeys-lru`` an evicted secret is stored again by the first running process that notices
(within ``secret_interval``), but a process started before that stores a new one, which every
process then follows, and what was recorded under the old one is no longer matched
(:mod:`proxy.store.redis.secret`). Either policy is otherwise safe: a missing parent, body or
list is a miss, never an error.

**Failure.** Every call is bounded by ``timeout`` and raises
:class:`~proxy.errors.StoreError` on any Redis error; Redis out of reach opens a breaker
and the store resumes by itself when it answers again (:mod:`proxy.store.redis.link`).
Until Redis has answered once, :meth:`RedisStore.secret` raises
:class:`~proxy.errors.StoreError`: a process started while Redis is down serves, unrepaired,
and names no tenant until then (:data:`proxy.edge.tenancy.UNKNOWN_TENANT`, whose reads and writes
this store refuses). Damaged keys (another type than kvwarm keeps there) are counted corrupt
entries and read as absent, never errors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ...core.model import Node, SessionTotals, TurnWrite
from ...errors import ConfigError, StoreError
from ..base import SessionInfo, StoreStats, StoreView
from ..tokens import TokenCounter, TokenCounts
from ..urls import SCHEMES, is_redis_url, redacted
from .admin import RedisAdmin
from .affinity import RedisAffinity
from .cache import CACHE_NODE_OVERHEAD, NodeCache, RedisCounters
from .codec import INLINE_MAX, ReplyDecoder, encode_node
from .layout import KeyLayout
from .link import Client, RedisLink
from .reads import RedisReads
from .scripts import FILL, PATH, SESSIONS, WRITE, WRITE_TOKEN_MS
from .view import CHILDREN_LIMIT, IDENTITY_LIMIT, RedisView
from .writes import ANNOUNCE_EVERY, INDEX_CAP, TOUCH_SLACK_MS, RedisWrites

__all__ = [
    "ANNOUNCE_EVERY",
    "CACHE_NODE_OVERHEAD",
    "CHILDREN_LIMIT",
    "FILL",
    "IDENTITY_LIMIT",
    "INDEX_CAP",
    "INLINE_MAX",
    "PATH",
    "SESSIONS",
    "TOUCH_SLACK_MS",
    "WRITE",
    "WRITE_TOKEN_MS",
    "NodeCache",
    "RedisAffinity",
    "RedisCounters",
    "RedisStore",
    "RedisView",
    "encode_node",
    "is_redis_url",
]


class RedisStore:
    """The transcript tree in Redis, shared by every process that opens the same URL.

    ``url``: one of the forms in the module docstring. ``ttl_seconds``: the sliding expiry
    of every key. ``secret``: the tenant-hash secret, or ``None`` to share one through
    Redis. ``timeout``: the bound of every call (seconds). ``cache_bytes``: the process
    cache of nodes. ``prefix``: the key prefix. ``health_check_interval``: idle seconds
    before redis-py pings a pooled connection. ``retries``: redis-py retries of one command
    on a connection error (with exponential backoff). ``probe_backoff``: first and longest
    pause between probes while Redis is unreachable. ``secret_interval``: seconds between two
    checks of the shared secret (:meth:`~proxy.store.redis.secret.SharedSecret.sync`).
    ``clock``: stamps session updates.
    """

    shared = True

    def __init__(
        self,
        url: str,
        *,
        ttl_seconds: float,
        secret: bytes | None = None,
        timeout: float = 0.25,
        cache_bytes: int = 64 << 20,
        prefix: str = "kvwarm",
        health_check_interval: float = 10.0,
        retries: int = 1,
        probe_backoff: tuple[float, float] = (0.05, 2.0),
        secret_interval: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not is_redis_url(url):
            raise ConfigError("store.backend", f"expected a redis URL ({', '.join(s + '://' for s in SCHEMES)})")
        layout = KeyLayout(prefix)
        if ttl_seconds <= 0:
            raise ConfigError("store.ttl_seconds", "must be > 0 for a redis store")
        if timeout <= 0:
            raise ConfigError("store.timeout", "must be > 0")
        self.url = url
        self.timeout = timeout
        self.counters = RedisCounters()
        self._prefix = prefix
        self._cache = NodeCache(cache_bytes)
        self._link = RedisLink(
            url,
            timeout=timeout,
            counters=self.counters,
            secret_key=layout.secret,
            secret=secret,
            health_check_interval=health_check_interval,
            retries=retries,
            probe_backoff=probe_backoff,
            secret_interval=secret_interval,
        )
        self._layout = layout
        decoder = ReplyDecoder(self._cache, self.counters)
        self._reads = RedisReads(self._link, layout, self._cache, self.counters, decoder)
        self._admin = RedisAdmin(self._link, layout, self._cache, self.counters, decoder)
        self._writes = RedisWrites(
            self._link,
            layout,
            self._cache,
            self.counters,
            ttl_seconds=ttl_seconds,
            tenant_of=self._admin.tenant_of,
            totals=self._admin.totals,
            clock=clock,
        )

    @property
    def _client(self) -> Client | None:
        """The redis-py client (None until opened)."""
        return self._link.client

    @property
    def _cluster(self) -> tuple[list[tuple[str, int]], str | None, str | None, bool] | None:
        """A cluster URL's (nodes, user, password, tls); None for one server."""
        return self._link.cluster

    # -- lifecycle ----------------------------------------------------------------------------

    async def open(self) -> None:
        """Connect, and load (or create) the shared secret. Redis being down is no error here:
        the store starts degraded and the probe connects it when Redis answers."""
        await self._link.open()

    async def close(self) -> None:
        await self._link.close()

    async def flush(self) -> None:
        """Nothing is pending: every write reached Redis when its call returned."""
        return None

    def evict(self, now: float) -> int:
        """Redis expires keys itself (sliding TTL) and evicts by its ``maxmemory-policy``."""
        return 0

    def secret(self) -> bytes:
        """The shared secret as agreed with Redis now (it may change while running:
        :mod:`proxy.store.redis.secret`); raises :class:`StoreError` until Redis has answered once."""
        secret = self._link.secret.value
        if secret is None:
            raise StoreError(f"the redis store {redacted(self.url)} has not answered yet: its shared secret is unknown")
        return secret

    def health(self) -> str:
        return self._link.health()

    def stats(self) -> StoreStats:
        """The process cache (Redis itself is not asked: this runs at scrape time).
        ``sessions`` is 0: only Redis knows, and :meth:`sessions` lists them."""
        cache = self._cache
        return StoreStats(
            nodes=len(cache),
            bytes=cache.bytes,
            blobs=cache.blobs,
            sessions=0,
            corrupt=self.counters.corrupt,
            evicted=cache.evicted,
        )

    # -- the request path ---------------------------------------------------------------------

    def view(self, tenant: bytes | None = None) -> RedisView:
        """A read view for one request of ``tenant`` (its root). Without a tenant the view
        answers from the process cache only, and its fill raises :class:`StoreError`."""
        return self._reads.view(tenant)

    async def fill(self, view: StoreView) -> bool:
        """Fetch what the view missed, and the chain it wants, in one round trip (one per
        tenant); True when planning again may give another answer."""
        return await self._reads.fill(view)

    async def write_turn(self, turn: TurnWrite) -> None:
        await self._writes.write_turn(turn)

    def token_counts(self, counter: TokenCounter) -> TokenCounts:
        """Every node is counted before it is written: each process reads the counts of all."""
        return TokenCounts(counter, self.view)

    def affinity(self, ttl_seconds: float) -> RedisAffinity:
        """The router's affinity table kept in this store, entries expiring ``ttl_seconds``
        after their last write; from now on each fill brings the entries of its chain."""
        affinity = RedisAffinity(self._link, self._layout, ttl_seconds)
        self._reads.affinity = affinity
        return affinity

    # -- writes and the admin side ------------------------------------------------------------

    async def insert(self, nodes: Sequence[Node]) -> int:
        return await self._writes.insert(nodes)

    async def add_turn(
        self, leaf: bytes, parent_leaf: bytes | None, totals: SessionTotals, tenant: bytes | None = None
    ) -> SessionTotals:
        return await self._writes.add_turn(leaf, parent_leaf, totals, tenant)

    async def path(self, leaf: bytes, tenant: bytes | None = None) -> list[Node]:
        """Element 0 down to ``leaf``; empty when any is missing. ``tenant`` spares a lookup
        (else the process cache, or a look-up in every known tenant, names it)."""
        return await self._admin.path(leaf, tenant)

    async def totals(self, leaf: bytes, tenant: bytes | None = None) -> SessionTotals | None:
        return await self._admin.totals(leaf, tenant)

    async def sessions(self, tenant: bytes | None = None) -> list[SessionInfo]:
        """Sessions most recently updated first; every tenant's when ``tenant`` is None."""
        return await self._admin.sessions(tenant)
