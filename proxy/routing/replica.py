"""One replica of the upstream pool: its sender, what kvwarm learned about it, its health and load.

A replica is one ``upstream.base_url``. Its :class:`~proxy.transport.traits.UpstreamTraits`
are its own (one replica may be a llama.cpp server reporting ``timings``, the next a
vLLM server): the bytes a request is sent with depend on the replica it goes to.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from yarl import URL

from ..transport.client import UpstreamSender
from ..transport.traits import UpstreamTraits
from .health import Health

__all__ = ["Replica", "replica_labels"]


@dataclass(slots=True, eq=False, kw_only=True)
class Replica:
    """One upstream replica and its live state (the event loop's only: no locking)."""

    index: int
    """Position in ``upstream.base_url``."""
    sender: UpstreamSender
    label: str
    """The ``upstream`` metric label: ``host:port`` (with the path when two replicas share one)."""
    health: Health
    base_url: str = field(init=False, default="")
    """The sender's base URL."""
    ident: bytes = field(init=False, default=b"")
    """The name rendezvous hashing and the affinity table use: the base URL's bytes (the same in
    every process configured with this pool, whatever the order of the list)."""
    traits: UpstreamTraits = field(default_factory=UpstreamTraits)
    """What this replica has shown (see :mod:`proxy.transport.traits`)."""
    inflight: int = 0
    """Requests sent here whose responses are not finished."""
    requests: int = 0
    """Requests sent here since start."""
    ejections: int = 0
    """Times it was ejected since start."""

    def __post_init__(self) -> None:
        self.base_url = self.sender.base_url
        self.ident = self.base_url.encode()


def replica_labels(base_urls: list[str]) -> list[str]:
    """Bounded, credential-free metric labels: ``host:port``, plus the path where two share one."""
    plain = [_host_port(u) for u in base_urls]
    twice = {label for label, n in Counter(plain).items() if n > 1}
    out = []
    for url, label in zip(base_urls, plain, strict=True):
        if label in twice:
            label += URL(url).path.rstrip("/") or "/"
        out.append(label)
    return out


def _host_port(url: str) -> str:
    parsed = URL(url)
    return f"{parsed.host or '?'}:{parsed.port or ''}"
