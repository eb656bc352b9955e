"""Building the configured transcript store from ``store.*`` settings."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .base import TranscriptStore
from .memory import MemoryStore
from .sqlite import SqliteStore

SQLITE_PREFIX = "sqlite:"


def make_store(
    backend: str,
    *,
    ttl_seconds: float,
    max_bytes: int,
    secret: str,
    flush_interval: float,
) -> TranscriptStore:
    """``"memory"`` or ``"sqlite:PATH"`` (PATH's parent directories are created).

    An empty ``secret`` lets the store choose: random per process for ``memory``, kept in
    ``PATH.secret`` for sqlite. The store is returned unopened; the caller owns
    ``open()`` / ``close()``.
    """
    key = secret.encode() if secret else None
    if backend == "memory":
        return MemoryStore(ttl_seconds, max_bytes, key)
    if backend.startswith(SQLITE_PREFIX) and len(backend) > len(SQLITE_PREFIX):
        path = Path(backend[len(SQLITE_PREFIX) :])
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("store.backend", f"cannot create {path.parent}: {exc.strerror}") from exc
        return SqliteStore(path, ttl_seconds, max_bytes, key, flush_interval)
    raise ConfigError("store.backend", f"expected 'memory' or 'sqlite:PATH', got {backend!r}")
