"""Placing one request on a replica: rendezvous hashing, bounded load, the three policies. Pure.

``prefix`` (the default for a pool)
    A request whose matched prefix has a home (:mod:`proxy.routing.affinity`) goes home
    (``affinity``), unless home is unavailable or :func:`spills` says the imbalance is
    large: then the least-loaded replica takes it (``spill``) and becomes the session's
    home. A request without a home (a new session: nothing matched past its leading
    prefix) goes by rendezvous hashing of its leading prefix, the chain key of tools +
    first message (``new``), so sessions sharing a system prompt share one replica's
    cached prefix until bounded load spreads them to the next replica in the same
    rendezvous order.
``round_robin``, ``least_inflight``
    What their names say, over the available replicas.

**Bounded load** ("consistent hashing with bounded loads", Mirrokni, Thorup and
Zadimoghaddam, 2018): with ``m`` requests in flight on the ``n`` available replicas and
the request being placed counted, each replica's capacity is
``ceil(max_load_factor * (m + 1) / n)``; a replica at capacity is *overloaded* and takes
may take no more. The capacity is above the mean, so some replica always has room.

**Leaving home takes an absolute imbalance too** (the SGLang router's cache-aware policy
balances only when ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold
* min``): a session leaves an overloaded home only when the home holds more than
``routing.balance_abs_threshold`` requests beyond the least-loaded replica. Moving a session
costs a prefill of its whole history on the new replica, while an engine that batches serves
a few more requests in flight for little; at low load the relative bound alone moved agent
sessions back and forth (with two requests in flight per replica on average, three on one
of them is already "overloaded"). New sessions are spread by bounded load alone (unlike
SGLang's router, which piles them where their stem is cached until the imbalance is large):
a new session placed away from its siblings prefills only the shared stem (tools and system
prompt) once per replica, while piling every session of a stem onto one replica exhausts
that replica's KV, which kvwarm cannot see (``tests/routing/test_bench.py``: a pool whose
replicas each hold a quarter of the sessions' prefixes loses most of what spreading keeps).
Once homed, sessions rarely move, so
where new sessions start is what balances the pool.

**Rendezvous hashing** (highest random weight): each replica scores
``H(key || replica)``; the replicas in descending score order are the key's preference
list. Adding or removing a replica moves only the keys whose first choice it was.

Every function takes the replicas already filtered to the available ones, each a
:class:`Candidate` (its name and in-flight count), and returns an index into them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Protocol

__all__ = [
    "Candidate",
    "capacity",
    "least_loaded",
    "overloaded",
    "preference",
    "rendezvous_score",
    "spills",
]


class Candidate(Protocol):
    """What placement reads of a replica."""

    @property
    def ident(self) -> bytes:
        """Stable name (its base URL's bytes): the same in every process with the same pool."""
        ...

    @property
    def inflight(self) -> int: ...


def rendezvous_score(key: bytes, ident: bytes) -> int:
    """The weight of replica ``ident`` for ``key`` (64 bits of BLAKE2b)."""
    return int.from_bytes(hashlib.blake2b(key + b"\x00" + ident, digest_size=8).digest(), "big")


def preference(key: bytes, candidates: Sequence[Candidate]) -> list[int]:
    """Indices of ``candidates`` in ``key``'s rendezvous order, first choice first."""
    scores = [rendezvous_score(key, c.ident) for c in candidates]
    return sorted(range(len(candidates)), key=lambda i: scores[i], reverse=True)


def capacity(candidates: Sequence[Candidate], factor: float) -> int:
    """In-flight requests a replica may hold before it is overloaded (the new request counted)."""
    total = sum(c.inflight for c in candidates)
    return max(1, math.ceil(factor * (total + 1) / max(1, len(candidates))))


def overloaded(candidate: Candidate, cap: int) -> bool:
    return candidate.inflight >= cap


def spills(home: Candidate, candidates: Sequence[Candidate], cap: int, margin: int) -> bool:
    """A session leaves ``home`` (one of ``candidates``): it is overloaded (``cap``) *and* holds
    more than ``margin`` requests in flight beyond the least-loaded candidate. ``margin`` 0 is
    bounded load alone (an overloaded replica is above the mean, so some replica holds fewer)."""
    return overloaded(home, cap) and home.inflight - min(c.inflight for c in candidates) > margin


def least_loaded(candidates: Sequence[Candidate], order: Sequence[int]) -> int:
    """The candidate with the fewest requests in flight; ties go to the earliest in ``order``."""
    best = order[0]
    for i in order:
        if candidates[i].inflight < candidates[best].inflight:
            best = i
    return best
