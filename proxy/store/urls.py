"""Which ``store.backend`` values name a shared Redis store (no Redis client imported here)."""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["SCHEMES", "is_redis_url", "redacted"]

SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


def is_redis_url(backend: str) -> bool:
    """Whether ``backend`` names a Redis store (one of the URL forms of :mod:`proxy.store.redis.store`)."""
    scheme, sep, _ = backend.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def redacted(backend: str) -> str:
    """``backend`` fit for a log line: a URL's credentials replaced by ``***``."""
    if "://" not in backend:
        return backend
    parts = urlsplit(backend)
    if "@" not in parts.netloc:
        return backend
    return backend.replace(parts.netloc, "***@" + parts.netloc.rpartition("@")[2], 1)
