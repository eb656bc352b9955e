"""Building the configured transcript store from ``store.*`` settings."""

from __future__ import annotations

from pathlib import Path

from ..config import StoreSettings
from ..errors import ConfigError
from .base import AsyncStore
from .local import LocalStore
from .memory.store import MemoryStore
from .sqlite.store import SqliteStore
from .urls import is_redis_url

SQLITE_PREFIX = "sqlite:"


def make_store(settings: StoreSettings, *, set_aside_damaged: bool = True) -> AsyncStore:
    """``memory``, ``sqlite:PATH`` (PATH's parent directories are created) or a Redis URL.

    An empty ``secret`` lets the store choose: random per process for ``memory``, kept in
    ``PATH.secret`` for sqlite, shared through Redis for redis. The store is returned
    unopened; the caller owns ``open()`` / ``close()``. ``set_aside_damaged``: a damaged
    sqlite file is moved aside (the server) or only reported (reading commands).
    """
    backend = settings.backend
    key = settings.secret.encode() if settings.secret else None
    if backend == "memory":
        return LocalStore(MemoryStore(settings.ttl_seconds, settings.max_bytes, key))
    if backend.startswith(SQLITE_PREFIX) and len(backend) > len(SQLITE_PREFIX):
        path = Path(backend[len(SQLITE_PREFIX) :])
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("store.backend", f"cannot create {path.parent}: {exc.strerror}") from exc
        store = SqliteStore(path, settings.ttl_seconds, settings.max_bytes, key, settings.flush_interval)
        store.set_aside_damaged = set_aside_damaged
        return LocalStore(store)
    if is_redis_url(backend):
        from .redis.store import RedisStore  # the Redis client is imported only when used

        return RedisStore(
            backend,
            ttl_seconds=settings.ttl_seconds,
            secret=key,
            timeout=settings.timeout,
            cache_bytes=settings.cache_bytes,
            prefix=settings.redis_prefix,
        )
    raise ConfigError("store.backend", f"expected 'memory', 'sqlite:PATH' or a redis:// URL, got {backend!r}")
