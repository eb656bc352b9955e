"""The Redis store's connection: the client, every call bounded and converted, the breaker and its probe.

**Client.** redis-py's asyncio client (hiredis parser): :class:`~redis.asyncio.Redis` from the
URL, or :class:`~redis.asyncio.cluster.RedisCluster` for a ``+cluster`` URL, whose listed
nodes are only where discovery starts. Socket timeouts are ``timeout``; redis-py retries a
command once on a connection error, with exponential backoff; an idle pooled connection is
pinged before reuse.

**Failure.** Every call goes through :meth:`RedisLink.guarded`: bounded by ``timeout`` (an
overall deadline on top of the socket timeouts), and any Redis error becomes a
:class:`~proxy.errors.StoreError`. A connection error or a timeout opens the breaker: calls
fail at once, :meth:`RedisLink.health` says ``"degraded: ..."``, and a background probe pings
with exponential backoff until Redis answers, when the store resumes by itself. A caller whose
own deadline catches a call waiting on Redis for long trips it too (Redis is slow). An OOM
answer (``maxmemory`` reached) is reported by ``health`` until a write succeeds again.

**Secret.** With no configured secret, the first process stores 32 random bytes under
``P:secret`` with ``SET NX`` and every process reads that value back when it connects, so
all of them key tenant roots alike. A configured secret is used as is (configure the same one
everywhere). Until Redis has answered once, the secret is unknown.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from redis import exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from ..errors import ConfigError, StoreError
from .redis_cache import RedisCounters
from .redis_scripts import Script
from .urls import redacted

__all__ = ["Client", "RedisLink", "cluster_url"]

log = logging.getLogger(__name__)

Client = Redis | RedisCluster

_DOWN_ERRORS: tuple[type[BaseException], ...] = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    rexc.ClusterError,
    rexc.RedisClusterException,
    OSError,
    TimeoutError,
)
"""Errors that mean Redis is unreachable or too slow: they open the breaker."""
_ANY_ERRORS: tuple[type[BaseException], ...] = (*_DOWN_ERRORS, rexc.RedisError, StoreError)


def cluster_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None, bool]:
    """``redis+cluster://[[user]:password@]host:port[,host:port...]``: (nodes, user, password, tls)."""
    parts = urlsplit(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    username, _, password = auth.partition(":")
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit():
            raise ConfigError("store.backend", f"cluster node {item!r} is not host:port")
        nodes.append((host, int(port)))
    if parts.path.strip("/") not in ("", "0") or parts.query:
        raise ConfigError("store.backend", "a Redis Cluster URL takes no database and no options")
    return nodes, unquote(username) or None, unquote(password) or None, parts.scheme.lower() == "rediss+cluster"


class RedisLink:
    """The client of one store, its breaker and probe, and the shared secret it loads.

    ``secret_key``: where the shared secret lives; ``secret``: a configured one (then Redis is
    not asked). ``health_check_interval``, ``retries``, ``probe_backoff``: see the store.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float,
        counters: RedisCounters,
        secret_key: str,
        secret: bytes | None,
        health_check_interval: float,
        retries: int,
        probe_backoff: tuple[float, float],
    ) -> None:
        self.url = url
        self.timeout = timeout
        self.counters = counters
        self.cluster = cluster_url(url) if url.partition("://")[0].lower().endswith("+cluster") else None
        if self.cluster is None:
            try:
                parse_url(url)
            except ValueError as exc:
                raise ConfigError("store.backend", f"{redacted(url)}: {exc}") from exc
        self.client: Client | None = None
        self.down: str | None = "not opened"
        """Why calls are refused right now (the breaker is open), or None."""
        self.full: str | None = None
        """Redis refused a write for want of memory (until a write succeeds), or None."""
        self.secret: bytes | None = secret or None
        self._configured_secret = self.secret
        self._secret_key = secret_key
        self._health_check_interval = health_check_interval
        self._retries = retries
        self._probe_backoff = probe_backoff
        self._wake = asyncio.Event()
        self._prober: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def _connect(self) -> Client:
        common: dict[str, Any] = {
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            "retry": Retry(ExponentialBackoff(cap=min(0.5, self.timeout / 2), base=0.005), self._retries),
            "health_check_interval": self._health_check_interval,
            "decode_responses": False,
            "client_name": "kvwarm",
        }
        if self.cluster is None:
            return Redis.from_url(self.url, **common)
        nodes, username, password, ssl = self.cluster
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes],
            username=username,
            password=password,
            ssl=ssl,
            **common,
        )

    async def open(self) -> None:
        """Connect, and load (or create) the shared secret. Redis being down is no error here:
        the link starts degraded and the probe connects it when Redis answers."""
        if self.client is not None:
            return
        self.client = self._connect()
        self._prober = asyncio.get_running_loop().create_task(self._probe_loop(), name="kvwarm-redis-probe")
        try:
            async with asyncio.timeout(self.timeout * 4):
                await self.client.execute_command("PING")
                await self._load_secret()
        except _ANY_ERRORS as exc:
            log.warning("redis store %s unreachable at start: %s", redacted(self.url), exc)
            self.trip(f"unreachable: {exc or type(exc).__name__}")
            return
        self.down = None

    async def close(self) -> None:
        prober, self._prober = self._prober, None
        if prober is not None:
            prober.cancel()
            try:
                await prober
            except asyncio.CancelledError:
                pass
        client, self.client = self.client, None
        if client is not None:
            await client.aclose()
        self.down = "closed"

    def health(self) -> str:
        if self.down is not None:
            return f"degraded: redis {self.down}"
        if self.full is not None:
            return f"degraded: redis {self.full}"
        return "ok"

    # -- the breaker ----------------------------------------------------------------------

    def trip(self, reason: str) -> None:
        """Open the breaker: calls fail at once until the probe reaches Redis again."""
        if self.down is None:
            log.warning("redis store %s degraded: %s", redacted(self.url), reason)
        self.down = reason
        self._wake.set()

    async def _probe_loop(self) -> None:
        first, longest = self._probe_backoff
        delay = first
        while True:
            await self._wake.wait()
            await asyncio.sleep(delay)
            client = self.client
            if client is None:
                return
            try:
                async with asyncio.timeout(self.timeout * 4):
                    await client.execute_command("PING")
                    if self.secret is None:
                        await self._load_secret()
            except _ANY_ERRORS as exc:
                delay = min(delay * 2, longest)
                self.down = f"unreachable: {exc or type(exc).__name__}"
                continue
            log.info("redis store %s reachable again", redacted(self.url))
            self.down = None
            self._wake.clear()
            delay = first

    async def _load_secret(self) -> None:
        if self._configured_secret is not None:
            return
        client = self.require()
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("SET", self._secret_key, secrets.token_bytes(32), "NX")
        pipe.execute_command("GET", self._secret_key)
        _, value = await pipe.execute()
        if not isinstance(value, bytes) or not value:
            raise StoreError(f"{self._secret_key} holds no secret")
        self.secret = value

    # -- calls ----------------------------------------------------------------------------

    def require(self) -> Client:
        if self.client is None:
            raise StoreError("the redis store is not open")
        return self.client

    async def guarded(self, what: str, call: Callable[[Client], Any]) -> Any:
        """Run ``call(client)`` within ``timeout``; every failure becomes a StoreError."""
        if self.down is not None:
            self.counters.errors += 1
            raise StoreError(f"redis store {what}: redis {self.down}")
        client = self.require()
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout):
                result = await call(client)
        except asyncio.CancelledError:
            # The caller's deadline: when it caught us waiting on Redis for long, Redis is slow.
            if time.monotonic() - started >= self.timeout / 2:
                self.trip(f"slow: no answer in {time.monotonic() - started:.3f}s")
            raise
        except _DOWN_ERRORS as exc:
            self.counters.errors += 1
            self.trip(f"unreachable: {exc or type(exc).__name__}")
            raise StoreError(f"redis store {what}: {exc or type(exc).__name__}") from exc
        except rexc.ResponseError as exc:
            self.counters.errors += 1
            if isinstance(exc, rexc.OutOfMemoryError) or str(exc).startswith("OOM"):
                self.full = "out of memory (maxmemory reached; set maxmemory-policy volatile-ttl)"
            raise StoreError(f"redis store {what}: {exc}") from exc
        except rexc.RedisError as exc:
            self.counters.errors += 1
            raise StoreError(f"redis store {what}: {exc}") from exc
        return result

    async def eval(self, client: Client, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except rexc.NoScriptError:
            await client.execute_command("SCRIPT LOAD", script.source)
            return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)

    async def pipeline(self, client: Client, ops: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Commands in one round trip (per node in a cluster); a script is ``(Script, keys, args)``.

        A script the server lost (restart) is loaded and re-run alone; any other error raises."""
        if len(ops) == 1 and isinstance(ops[0][0], Script):
            script, keys, args = ops[0]
            return [await self.eval(client, script, keys, args)]
        pipe = client.pipeline(transaction=False)
        for op in ops:
            if isinstance(op[0], Script):
                script, keys, args = op
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            else:
                pipe.execute_command(*op)
        results: list[Any] = await pipe.execute(raise_on_error=False)
        for i, (op, result) in enumerate(zip(ops, results, strict=True)):
            if isinstance(result, rexc.NoScriptError) and isinstance(op[0], Script):
                results[i] = await self.eval(client, op[0], op[1], op[2])
            elif isinstance(result, Exception):
                raise result
        return results

    async def run(self, what: str, ops: Sequence[tuple[Any, ...]]) -> list[Any]:
        """:meth:`pipeline` of ``ops``, guarded."""
        return list(await self.guarded(what, lambda client: self.pipeline(client, ops)))
