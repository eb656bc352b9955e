"""Whether a keep-alive ping pays: its expected saving against its cost. Pure.

A session's cached prefix expires ``ttl`` seconds after its last read. Without a ping, a
session that comes back later writes the whole prefix again (at the write price); with one
sent shortly before expiry, it reads it (at the cached price). A ping costs the prefix read at
the cached price, its uncached tail (the few tokens after the last marker) and its output.

The brief's bet is one ping: send it when the chance the session comes back within the next TTL
(given it has not come back yet), times the write it avoids, exceeds the ping's cost. A session
that pauses longer than one TTL needs several pings in a row, and the first of them alone never
looks worth it; so :func:`best_run` prices every run of ``k`` pings from now (``k = 1`` is the
one-ping bet), each sent only while the session has not come back::

    value(k) = saving * P(back between the current expiry and the last ping's expiry | not back yet)
             - cost   * E[pings of the k sent | pings stop when it is back]

and a ping goes when the best run's value is positive. Each later ping is decided again, on the
history as it is then: this is a bet re-priced at every step, never a commitment to ``k`` pings.

The odds are the tenant's own pauses (:class:`~proxy.keepalive.gaps.Gaps`), with
:data:`PRIOR_NEVER` more session that never came back: with no history nothing is sent.

On a watched session (:class:`~proxy.keepalive.watch.Watch`): :func:`decide` prices its next
ping as it falls due, and :func:`saved` says what its pings came to once it came back (or never
did).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.pricing import Price, PriceTable
from ..core.usage import Usage
from .gaps import Gaps, TenantGaps
from .watch import Watch

__all__ = ["MAX_RUN", "PRIOR_NEVER", "Stake", "Timing", "best_run", "decide", "saved", "stake", "write_bucket"]

PRIOR_NEVER = 1.0
"""A session that never came back, added to every tenant's history: no history, no ping; one
return is not taken for a certainty."""
MAX_RUN = 288
"""Longest run of pings priced (a day of 5-minute TTLs): bounds the work of one decision."""
_PER_TOKEN = 1e-6
_BUCKETS = {300.0: "5m", 3600.0: "1h", 1800.0: "30m", 43200.0: "12h"}


def write_bucket(ttl: float) -> str:
    """The price table's write bucket of a TTL in seconds (``unknown``: priced as the shortest)."""
    return _BUCKETS.get(ttl, "unknown")


@dataclass(frozen=True, slots=True, kw_only=True)
class Stake:
    """What one ping of a session costs and what a return it bridges saves, in USD."""

    ping: float
    """The ping's expected cost: the prefix read at the cached price, the uncached tail, the output."""
    worst: float
    """Its cost if the provider had lost the prefix: the prefix written again (what the budget holds back)."""
    saving: float
    """The write a session coming back while the prefix is kept avoids: the part of the prefix it
    would not read anyway, at the write price less the read it makes instead."""


def stake(price: Price, *, prefix: int, tail: int, output: int, bucket: str, read_anyway: float = 0.0) -> Stake:
    """The stake of a ping re-reading ``prefix`` cached tokens with ``tail`` uncached ones after
    them and at most ``output`` generated, for a prefix written in TTL ``bucket``; a late return
    reads ``read_anyway`` tokens of it without the ping (:attr:`~proxy.keepalive.gaps.Gaps.read_anyway`)."""
    read, write = price.read_rate(), price.write_rate(bucket)
    rest = tail * price.input + output * price.output
    return Stake(
        ping=(prefix * read + rest) * _PER_TOKEN,
        worst=(prefix * max(write, price.input) + rest) * _PER_TOKEN,
        saving=max(0.0, (prefix - read_anyway) * (write - read) * _PER_TOKEN),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """Where a session stands when a ping falls due, in seconds since its last turn."""

    elapsed: float
    """Now."""
    expires: float
    """When the prefix expires without this ping."""
    interval: float
    """Between two pings: the TTL less the lead (a ping goes ``lead`` seconds before expiry)."""
    ttl: float
    """How long a ping keeps the prefix."""
    max_age: float
    """No ping after this (``keepalive.max_session_seconds``)."""

    def pings_left(self) -> int:
        """Pings that may still go, this one included: those at ``elapsed + j * interval <= max_age``."""
        if self.elapsed > self.max_age or self.interval <= 0:
            return 0
        return min(MAX_RUN, int((self.max_age - self.elapsed) // self.interval) + 1)


def best_run(gaps: Gaps, timing: Timing, stake: Stake) -> tuple[int, float]:
    """The run of pings from now with the highest expected value (module docstring): its length
    and value in USD; ``(0, 0.0)`` when no run is worth anything (then no ping goes)."""
    alive = gaps.beyond(timing.elapsed) + PRIOR_NEVER
    back_anyway = gaps.beyond(timing.expires)
    best_k, best = 0, 0.0
    pings = 0.0
    for k in range(1, timing.pings_left() + 1):
        sent_at = timing.elapsed + (k - 1) * timing.interval
        pings += (gaps.beyond(sent_at) + PRIOR_NEVER) / alive  # the k-th goes if not back by then
        bridged = max(0.0, back_anyway - gaps.beyond(sent_at + timing.ttl)) / alive
        value = stake.saving * bridged - stake.ping * pings
        if value > best:
            best_k, best = k, value
    return best_k, best


def decide(watch: Watch, now: float, prices: PriceTable, gaps: TenantGaps, *, lead: float, max_age: float) -> Stake | str:
    """The stake of the session's next ping when a run of pings from ``now`` pays (a ping goes
    ``lead`` seconds before the prefix expires, none once the session is quiet past ``max_age``);
    else why not (``max_age``, ``unpriced``, ``skipped_unprofitable``: the outcome counted)."""
    elapsed = now - watch.turn_at
    if elapsed > max_age:
        return "max_age"
    price = prices.lookup(watch.model)
    if price is None:
        return "unpriced"
    tenant = gaps.of(watch.root)
    bet = stake(
        price, prefix=watch.prefix, tail=watch.tail, output=watch.output, bucket=write_bucket(watch.ttl),
        read_anyway=tenant.read_anyway,
    )
    timing = Timing(
        elapsed=elapsed, expires=watch.used_at + watch.ttl - watch.turn_at,
        interval=watch.ttl - lead, ttl=watch.ttl, max_age=max_age,
    )
    run, _ = best_run(tenant, timing, bet)
    return bet if run else "skipped_unprofitable"


def saved(watch: Watch, back_at: float | None, usage: Usage | None, prices: PriceTable, gaps: TenantGaps) -> float:
    """What the session's pings saved, in USD: the write avoided when it came back (at
    ``back_at``, with ``usage``; None: it never did) after the prefix would have expired, while the
    pings kept it, and read it; else 0 (their cost was lost)."""
    kept = back_at is not None and watch.turn_at + watch.ttl < back_at <= watch.used_at + watch.ttl
    read = usage is not None and usage.cached_tokens is not None and usage.cached_tokens >= watch.prefix
    price = prices.lookup(watch.model)
    if kept and read and not watch.missed and price is not None:
        anyway = gaps.of(watch.root).read_anyway
        return stake(price, prefix=watch.prefix, tail=0, output=0, bucket=write_bucket(watch.ttl), read_anyway=anyway).saving
    return 0.0
