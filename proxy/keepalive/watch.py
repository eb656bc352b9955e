"""One watched session: its last turn, what its prefix holds, and what its pings did. Pure.

A :class:`Watch` is made when a session's turn is recorded and lives until the session's next
turn arrives or its horizon (``keepalive.max_session_seconds`` plus the TTL after the turn)
passes. While pings may follow it is *active*: it holds the bytes the turn went upstream with,
the replica that served it and the session's credential; :meth:`Watch.close` drops all three
(when the pings end, the session comes back, or kvwarm stops), and they are never stored or
logged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.usage import Usage

if TYPE_CHECKING:
    from ..routing import Replica

__all__ = ["Watch"]


class Watch:
    """A session's last turn, watched (module docstring). Times are the keep-alive clock's."""

    __slots__ = (
        "api", "body", "dialect", "due", "headers", "horizon", "key", "missed", "model", "output", "path", "pings",
        "prefix", "query", "raw", "replica", "root", "spent", "tail", "ttl", "turn_at", "used_at",
    )

    def __init__(
        self, *, key: bytes, root: bytes, model: str, dialect: str, api: str, path: str, query: str,
        replica: Replica, raw: bytes, headers: tuple[tuple[str, str], ...], turn_at: float, ttl: float,
        prefix: int, tail: int, output: int, due: float, horizon: float,
    ) -> None:
        self.key = key
        """The chain key of the turn's last request element: the session's next turn matches it."""
        self.root = root
        """The tenant root: whose pauses the bet is priced on."""
        self.model = model
        self.dialect = dialect
        """The markers' dialect (``cache_control`` or ``openai``): where the ping is cut."""
        self.api = api
        """``chat``, ``responses`` or ``messages`` (:mod:`proxy.keepalive.ping`)."""
        self.path = path
        self.query = query
        """The request's path and raw query string, as the client sent them (``?beta=true``...)."""
        self.replica: Replica | None = replica
        """The replica that served the turn: the ping goes there and nowhere else (None: closed)."""
        self.raw = raw
        """The bytes the turn went upstream with, until the ping is made of them (``b""``: closed)."""
        self.body: bytes | None = None
        """The ping, once made."""
        self.headers: tuple[tuple[str, str], ...] | None = headers
        """The ping's headers: the API's and the session's credential (None: closed)."""
        self.turn_at = turn_at
        """When the turn arrived: its pause, and its pings' age, count from here."""
        self.used_at = turn_at
        """The prefix's last read: the turn, then each ping."""
        self.ttl = ttl
        self.prefix = prefix
        """Prompt tokens the turn read and wrote: the cached prefix a ping re-reads."""
        self.tail = tail
        """Prompt tokens after it, uncached (the turn's, then the last ping's)."""
        self.output = output
        """Output tokens a ping may generate (the API's least, then what the last ping made)."""
        self.due = due
        """When the watch falls due: its next ping (active), else its horizon."""
        self.horizon = horizon
        """When the session is taken never to come back."""
        self.pings = 0
        self.spent = 0.0
        """USD its pings cost."""
        self.missed = False
        """A ping found the prefix gone (the provider dropped it early): its pings ended."""

    @property
    def active(self) -> bool:
        """Pings may follow: the credential and bytes are held."""
        return self.headers is not None

    @property
    def replica_label(self) -> str:
        return self.replica.label if self.replica is not None else "(closed)"

    def read(self, usage: Usage, *, at: float, usd: float) -> None:
        """A ping sent ``at`` came back with ``usage`` and cost ``usd``."""
        self.pings += 1
        self.spent += usd
        self.used_at = at
        cached, prompt = usage.cached_tokens, usage.prompt_tokens
        if cached is not None and cached < self.prefix:
            self.missed = True
        elif cached is not None and prompt is not None:
            self.tail = max(0, prompt - cached - (usage.cache_write_tokens or 0))
        if usage.completion_tokens is not None:
            self.output = max(1, usage.completion_tokens)

    def close(self) -> None:
        """Drop the credential, the bytes and the replica: no ping follows."""
        self.headers = None
        self.raw = b""
        self.body = None
        self.replica = None
