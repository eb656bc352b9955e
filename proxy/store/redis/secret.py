"""The Redis store's shared secret: every process keys tenant roots alike, with the one Redis holds.

With no configured secret, the first process stores 32 random bytes under ``P:secret`` with
``SET NX`` and every process reads that value back when it connects, so all of them key
tenant roots alike. A configured secret is used as is (configure the same one everywhere).
Until Redis has answered once, the secret is unknown (the request path then names no tenant
and forwards unrepaired, :mod:`proxy.edge.tenancy`).

Redis may lose the key (a restart without persistence, ``FLUSHALL``) while processes run.
Every chain key is an HMAC under the secret, so a newcomer that stored a secret of its own
would hash every tenant apart from the running processes: none would ever match the other's
turns. So the secret is checked again every ``secret_interval`` seconds, when the link
reconnects (:mod:`proxy.store.redis.link`), and when a write finds that Redis lost part of a
path (:meth:`SharedSecret.sync`): a process that finds the key missing stores its own secret
again with ``SET NX`` (the first to notice restores the shared one; Redis came back empty, so
nothing stored under another secret is lost), and a process whose secret differs from the
stored one follows the store, with one WARNING: the secret in Redis is the one every newcomer
adopts, so following it is the only choice on which every replica converges.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING

from redis import exceptions as rexc

from ...errors import StoreError

if TYPE_CHECKING:
    from .link import Client

__all__ = ["SharedSecret"]

log = logging.getLogger(__name__)


class SharedSecret:
    """The secret this process keys tenant roots with, as agreed with Redis.

    ``key``: where the shared secret lives; ``configured``: a configured one (then Redis is not
    asked); ``where``: the store, as the log names it (redacted).
    """

    def __init__(self, key: str, configured: bytes | None, where: str) -> None:
        self.value: bytes | None = configured or None
        """The secret now; None until Redis has answered once (when none is configured)."""
        self.configured = self.value is not None
        """A configured secret: never asked of Redis, never changed."""
        self.key = key
        self._where = where

    async def sync(self, client: Client) -> bool:
        """Agree with Redis on the shared secret (module docstring); True when this process's
        secret changed (the tenant roots it keyed no longer match the other processes').

        A missing key gets this process's secret (``SET NX``; a new random one when it knew
        none); a stored one that differs from this process's is followed. Not guarded: the
        callers convert errors (the link's probe and start, :meth:`RedisStore.write_turn`)."""
        if self.configured:
            return False
        mine = self.value
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("SET", self.key, mine if mine is not None else secrets.token_bytes(32), "NX")
        pipe.execute_command("GET", self.key)
        try:
            stored_now, value = await pipe.execute()
        except rexc.ResponseError as exc:
            raise StoreError(f"{self.key} is damaged ({exc}): delete it, and a process stores the secret again") from exc
        if not isinstance(value, bytes) or not value:
            raise StoreError(f"{self.key} holds no secret: delete it, and a process stores the secret again")
        if mine is not None and stored_now:
            log.warning(
                "redis store %s: %s was missing (Redis restarted empty?): stored this process's secret again, "
                "so processes started from now on adopt it",
                self._where, self.key,
            )
        if value == mine:
            return False
        if mine is not None:
            log.warning(
                "redis store %s: the shared secret in %s differs from this process's (Redis lost it and another "
                "process stored a new one): following the stored secret; sessions recorded under the old one "
                "are not matched again",
                self._where, self.key,
            )
        self.value = value
        return mine is not None
