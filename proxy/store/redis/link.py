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

**Secret.** The link holds the shared secret (:mod:`proxy.store.redis.secret`): it agrees
on it with Redis when it connects, every ``secret_interval`` seconds while Redis answers, and
when the probe reaches Redis again.

**Commands.** :func:`eval_script` and :func:`execute_ops` run a script, or a batch of commands
in one round trip, on a client, loading a script the server lost; the link's :meth:`RedisLink.run`
runs a batch guarded.

**Damage.** A key of another type than kvwarm keeps there (a string where a sessions index
belongs, a list for totals) is damage, not an outage: the scripts read it as absent and count
it, the writes replace it, and :meth:`RedisLink.read` answers :data:`DAMAGED` for one; each is
counted in ``counters.corrupt`` (``kvwarm_store_corrupt_entries``).
"""

from __future__ import annotations

import asyncio
import logging
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

from ...errors import ConfigError, StoreError
from ..urls import redacted
from .cache import RedisCounters
from .scripts import Script
from .secret import SharedSecret

__all__ = ["DAMAGED", "Client", "RedisLink", "cluster_url", "eval_script", "execute_ops", "wrong_type"]

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

DAMAGED: Any = object()
"""What :meth:`RedisLink.read` answers for a key of another type than the command reads."""


def wrong_type(exc: BaseException) -> bool:
    """True for Redis' answer to a command on a key of another type (``WRONGTYPE``)."""
    return isinstance(exc, rexc.ResponseError) and str(exc).startswith("WRONGTYPE")


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


async def eval_script(client: Client, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """``script`` run on ``client`` (``EVALSHA``; loaded first when the server lost it: a restart)."""
    try:
        return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    except rexc.NoScriptError:
        await client.execute_command("SCRIPT LOAD", script.source)
        return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)


async def execute_ops(client: Client, ops: Sequence[tuple[Any, ...]], lenient_from: int | None = None) -> list[Any]:
    """Commands in one round trip (per node in a cluster); a script is ``(Script, keys, args)``.

    A script the server lost (restart) is loaded and re-run alone; any other error raises,
    except a ``WRONGTYPE`` answer to an op from index ``lenient_from`` on, which is its result (the
    caller replaces the damaged key)."""
    if len(ops) == 1 and isinstance(ops[0][0], Script):
        script, keys, args = ops[0]
        return [await eval_script(client, script, keys, args)]
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
            results[i] = await eval_script(client, op[0], op[1], op[2])
        elif isinstance(result, Exception) and not (lenient_from is not None and i >= lenient_from and wrong_type(result)):
            raise result
    return results


class RedisLink:
    """The client of one store, its breaker and probe, and the shared secret it loads.

    ``secret_key``: where the shared secret lives; ``secret``: a configured one (then Redis is
    not asked). ``health_check_interval``, ``retries``, ``probe_backoff``, ``secret_interval``:
    see the store.
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
        secret_interval: float,
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
        self.secret = SharedSecret(secret_key, secret, redacted(url))
        """The shared secret, agreed with Redis by the link (and by a write that found a path lost)."""
        self._health_check_interval = health_check_interval
        self._retries = retries
        self._probe_backoff = probe_backoff
        self._secret_interval = secret_interval
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
        try:
            async with asyncio.timeout(self.timeout * 4):
                await self.client.execute_command("PING")
                await self.secret.sync(self.require())
        except _ANY_ERRORS as exc:
            log.warning(
                "redis store %s unreachable at start: %s; serving unrepaired until it answers", redacted(self.url), exc
            )
            self.trip(_reason(exc))
        else:
            self.down = None
        finally:
            self._prober = asyncio.get_running_loop().create_task(self._watch(), name="kvwarm-redis-probe")

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

    async def _watch(self) -> None:
        """The link's background task: while Redis answers, a check of the shared secret every
        ``secret_interval``; once the breaker opens, the probe until Redis answers again."""
        while self.client is not None:
            if self.down is None:
                await self._idle()
            else:
                await self._probe()

    async def _idle(self) -> None:
        """Until the breaker opens or ``secret_interval`` passes; then check the secret."""
        interval = None if self.secret.configured else self._secret_interval
        try:
            async with asyncio.timeout(interval):
                await self._wake.wait()
            return
        except TimeoutError:
            pass
        try:
            async with asyncio.timeout(self.timeout * 4):
                await self.secret.sync(self.require())
        except _ANY_ERRORS as exc:
            self.trip(_reason(exc))

    async def _probe(self) -> None:
        """Ping with exponential backoff until Redis answers and the secret is agreed, then close
        the breaker."""
        first, longest = self._probe_backoff
        delay = first
        while (client := self.client) is not None:
            await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(self.timeout * 4):
                    await client.execute_command("PING")
                    await self.secret.sync(self.require())
            except _ANY_ERRORS as exc:
                delay = min(delay * 2, longest)
                self.down = _reason(exc)
                continue
            log.info("redis store %s reachable again", redacted(self.url))
            self.down = None
            self._wake.clear()
            return

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

    async def run(self, what: str, ops: Sequence[tuple[Any, ...]], lenient_from: int | None = None) -> list[Any]:
        """:func:`execute_ops` of ``ops``, guarded."""
        return list(await self.guarded(what, lambda client: execute_ops(client, ops, lenient_from)))

    async def read(self, what: str, *command: Any) -> Any:
        """One command, guarded; :data:`DAMAGED` (counted corrupt) when its key holds another type."""

        async def call(client: Client) -> Any:
            try:
                return await client.execute_command(*command)
            except rexc.ResponseError as exc:
                if wrong_type(exc):
                    return DAMAGED
                raise

        result = await self.guarded(what, call)
        if result is DAMAGED:
            self.counters.corrupt += 1
        return result


def _reason(exc: BaseException) -> str:
    """Why the breaker opens on ``exc``: Redis out of reach, or what Redis answered."""
    if isinstance(exc, _DOWN_ERRORS):
        return f"unreachable: {exc or type(exc).__name__}"
    return str(exc) or type(exc).__name__
