"""The router: which replica of the pool takes a request, failover, and what each answer teaches.

The request path asks once per request (:meth:`Router.route`) and gets a
:class:`Route`; :meth:`Route.send` places the request (:mod:`proxy.routing.placement`),
has its :class:`Payload` made for that replica (the bytes depend on the replica's traits, and
carry the route's ``prompt_cache_key`` when one is due), and sends it. A request that could
not reach its replica before a byte was sent (refused, unreachable, connect timeout) is sent
to the next one, so no request fails while another replica could take it; the replica is
ejected. The answer comes back as a :class:`Lease`: the response, the replica, the outgoing
value. Once the turn is recorded, :meth:`Lease.done` settles the replica's health and
remembers the turn's prefix as living there (:mod:`proxy.routing.affinity`); leaving the
lease's ``with`` frees its in-flight slot.

With one upstream there is nothing to choose: the request goes there (its health is still
tracked and shown), no affinity is kept, and no routing decision is counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

from ..config import RoutingSettings
from ..core.guard import STRICT, Guard
from ..core.plan import TurnPlan
from ..errors import ProxyError
from ..metrics import ProxyMetrics
from ..transport.client import UpstreamSender, never_sent
from ..transport.pool import Response
from .affinity import Affinity, LocalAffinity
from .cache_key import FIELD, KeyShards, conversation_key, session_cache_key, with_prompt_cache_key
from .health import Health
from .placement import capacity, least_loaded, overloaded, preference, spills
from .replica import Replica, replica_labels

__all__ = ["DECISIONS", "Lease", "Route", "Router"]

log = logging.getLogger(__name__)

DECISIONS = ("affinity", "spill", "new", "failover", "round_robin", "least_inflight")
"""``kvwarm_routing_decisions_total{kind}``: how each placement on a pool was decided."""
LOOKUP_DEPTH = 64
"""Most matched keys (deepest first) looked up for a session's home."""
LEADING = 2
"""Keys ``0`` (tools) and ``1`` (first message) are the leading prefix, shared by every session
of a system prompt: never a session's home, the rendezvous key of a new one."""


class Outgoing(Protocol):
    """What a request is sent with (the wire's ``Outgoing``): its bytes, at least."""

    @property
    def body(self) -> bytes: ...


class Outcome(Protocol):
    """How the relay ended (``proxy.request.relay.RelayOutcome``), as far as the replica's health goes."""

    @property
    def upstream_error(self) -> BaseException | None: ...


OutT = TypeVar("OutT", bound=Outgoing)
OutT_co = TypeVar("OutT_co", bound=Outgoing, covariant=True)


class Payload(Protocol[OutT_co]):
    """What a request is sent with, made for the replica that takes it (the wire's bytes depend
    on the replica's traits), with the route's ``prompt_cache_key`` (:attr:`Route.cache_key`)."""

    def for_replica(self, replica: Replica) -> OutT_co: ...


class Router:
    """The pool's replicas, its policy, the affinity table and the ``prompt_cache_key`` shards."""

    def __init__(
        self,
        settings: RoutingSettings,
        senders: Sequence[UpstreamSender],
        metrics: ProxyMetrics | None = None,
        *,
        affinity: Affinity | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not senders:
            raise ValueError("a pool needs at least one upstream")
        labels = replica_labels([s.base_url for s in senders])
        self.replicas = tuple(
            Replica(index=i, sender=sender, label=label, health=Health(settings.eject_errors, settings.eject_window, settings.eject_seconds))
            for i, (sender, label) in enumerate(zip(senders, labels, strict=True))
        )
        self.pooled = len(self.replicas) > 1
        self.policy = settings.policy
        self.remembers = self.pooled and self.policy == "prefix"
        """Answers teach where a prefix lives (:meth:`remember`)."""
        self.factor = settings.max_load_factor
        self.margin = settings.balance_abs_threshold
        """Requests in flight a session's home may hold beyond the least-loaded replica before the
        session leaves it (:func:`~proxy.routing.placement.spills`)."""
        self.affinity: Affinity = affinity if affinity is not None else LocalAffinity(settings.affinity_entries)
        self.shards = KeyShards(settings.prompt_cache_key_rpm) if settings.prompt_cache_key == "session" else None
        self.metrics = metrics
        self.clock = clock
        self._by_url = {r.base_url: r for r in self.replicas}
        self._turn = 0
        if metrics is not None:
            metrics.track_upstreams({r.label: _inflight_of(r) for r in self.replicas}, DECISIONS)

    # -- per request ------------------------------------------------------------------------------

    def route(self, plan: TurnPlan | None, body: Mapping[str, Any] | None = None, guard: Guard = STRICT) -> Route:
        """The route of one request (``plan`` None: a request kvwarm does not read); its
        ``prompt_cache_key`` is worked out under ``guard`` (failing open: no key)."""
        key = None
        if self.shards is not None and plan is not None and plan.match is not None and body is not None and FIELD not in body:
            with guard("routing"):
                messages = plan.forwarded.get("messages")
                chain = conversation_key(plan.match.keys, messages if isinstance(messages, list) else ())
                if chain is not None:
                    key = self.shards.take(session_cache_key(plan.root, chain), self.clock())
        return Route(self, plan, key)

    async def place(self, plan: TurnPlan | None, tried: set[int]) -> tuple[Replica, str]:
        """The replica of a pool for the next attempt (none of ``tried``) and how it was chosen
        (one replica is taken without placing: :meth:`Route.send`)."""
        replicas = self.replicas
        now = self.clock()
        available = [r for r in replicas if r.index not in tried and r.health.available(now)]
        if not available:
            # Every replica left is ejected: the one that returns soonest is the last resort.
            rest = [r for r in replicas if r.index not in tried]
            return min(rest, key=lambda r: r.health.returns_at()), "failover"
        kind, i = await self._choose(plan, available)
        return available[i], "failover" if tried else kind

    async def _choose(self, plan: TurnPlan | None, available: list[Replica]) -> tuple[str, int]:
        self._turn += 1
        if self.policy == "round_robin":
            return "round_robin", self._turn % len(available)
        match = plan.match if plan is not None else None
        if self.policy != "prefix" or match is None or not match.keys:
            n = len(available)
            return "least_inflight", least_loaded(available, [(self._turn + k) % n for k in range(n)])
        keys = match.keys
        order = preference(keys[min(1, len(keys) - 1)], available)
        cap = capacity(available, self.factor)
        if match.matched > LEADING:
            deepest = match.matched - 1
            named = await self.affinity.lookup(match.root, keys[deepest : max(LEADING, deepest - LOOKUP_DEPTH) - 1 : -1])
            home = self._by_url.get(named) if named is not None else None
            if home is not None:
                if home in available and not spills(home, available, cap, self.margin):
                    return "affinity", available.index(home)
                # The least-loaded replica becomes home: remember() points the session's keys there.
                return "spill", least_loaded(available, order)
        for i in order:
            if not overloaded(available[i], cap):
                return "new", i
        return "new", least_loaded(available, order)

    async def remember(self, plan: TurnPlan | None, replica: Replica) -> None:
        """``replica`` answered ``plan``'s request: its prefix (from the deepest matched key on) lives there."""
        if not self.remembers or plan is None or plan.match is None:
            return
        keys = plan.match.keys
        start = max(plan.match.matched - 1, LEADING)
        if start < len(keys):
            await self.affinity.remember(plan.match.root, keys[start:], replica.base_url)

    # -- outcomes ---------------------------------------------------------------------------------

    def decided(self, kind: str) -> None:
        if kind and self.metrics is not None:
            self.metrics.observe_routing(kind)

    def sent(self, replica: Replica) -> None:
        replica.requests += 1
        if self.metrics is not None:
            self.metrics.observe_upstream_request(replica.label)

    def failed(self, replica: Replica, trial: bool, *, refused: bool, why: str) -> None:
        if replica.health.failure(self.clock(), trial, refused=refused):
            replica.ejections += 1
            if self.metrics is not None:
                self.metrics.observe_ejection(replica.label)
            log.warning(
                "upstream %s ejected for %g s: %s", replica.label, replica.health.eject_seconds, why
            )

    # -- the live page ----------------------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        """Each replica as the live page shows it (the base URL is the caller's to strip)."""
        now = self.clock()
        return [
            {
                "url": r.base_url,
                "label": r.label,
                "state": r.health.state(now),
                "inflight": r.inflight,
                "requests": r.requests,
                "ejections": r.ejections,
            }
            for r in self.replicas
        ]


def _inflight_of(replica: Replica) -> Callable[[], float]:
    return lambda: float(replica.inflight)


class Route:
    """One request's way to the pool: its placements, its failovers, its ``prompt_cache_key``."""

    __slots__ = ("cache_key", "plan", "router")

    def __init__(self, router: Router, plan: TurnPlan | None, cache_key: str | None) -> None:
        self.router = router
        self.plan = plan
        self.cache_key = cache_key
        """The ``prompt_cache_key`` this request gets (None: none is added)."""

    def keyed(self, raw: bytes) -> bytes:
        """The outgoing bytes, with this request's ``prompt_cache_key`` when it gets one."""
        return raw if self.cache_key is None else with_prompt_cache_key(raw, self.cache_key)

    async def send(
        self,
        method: str,
        path: str,
        query: str,
        headers: Mapping[str, str],
        payload: Payload[OutT],
    ) -> Lease[OutT]:
        """Place, make the payload for the replica, send; on a failure before any byte was
        sent, the next replica. Raises the last error when no replica could be reached."""
        router = self.router
        tried: set[int] = set()
        while True:
            if router.pooled:
                replica, kind = await router.place(self.plan, tried)
                router.decided(kind)
            else:
                replica = router.replicas[0]  # nothing to choose, nothing to count
            outgoing = payload.for_replica(replica)
            trial = replica.health.begin()
            replica.inflight += 1
            try:
                response = await replica.sender.send(method, path, query, headers, outgoing.body)
            except ProxyError as exc:
                replica.inflight -= 1
                refused = never_sent(exc)
                if not refused:
                    router.sent(replica)
                router.failed(replica, trial, refused=refused, why=str(exc))
                tried.add(replica.index)
                if refused and len(tried) < len(router.replicas):
                    log.info("upstream %s unreachable (%s); trying another replica", replica.label, exc)
                    continue
                raise
            except BaseException:
                replica.inflight -= 1
                replica.health.cancel(trial)
                raise
            router.sent(replica)
            return Lease(router=router, plan=self.plan, replica=replica, response=response, outgoing=outgoing, trial=trial)


@dataclass(slots=True, eq=False, kw_only=True)
class Lease(Generic[OutT]):
    """A request sent to a replica, until its response is over (``with`` frees the slot)."""

    router: Router
    plan: TurnPlan | None
    replica: Replica
    response: Response
    outgoing: OutT
    """What was sent (the bytes, and what the wire needs to read the response)."""
    trial: bool
    """The replica was not healthy when placed: this request's outcome decides its health."""
    settled: bool = False

    @property
    def sender(self) -> UpstreamSender:
        return self.replica.sender

    async def done(self, outcome: Outcome) -> None:
        """The response is over: the replica's health, and (answered) where the turn's prefix lives."""
        if self.settled:
            return
        self.settled = True
        status = self.response.status
        if outcome.upstream_error is not None or status >= 500:
            why = f"HTTP {status}" if outcome.upstream_error is None else str(outcome.upstream_error)
            self.router.failed(self.replica, self.trial, refused=False, why=why)
            return
        self.replica.health.success(self.trial)
        if 200 <= status < 300 and self.router.remembers:
            await self.router.remember(self.plan, self.replica)

    def __enter__(self) -> Lease[OutT]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.replica.inflight -= 1
        if self.settled:
            return
        self.settled = True  # the relay failed before the response was over
        status = self.response.status
        if isinstance(exc, ProxyError) or status >= 500:
            self.router.failed(self.replica, self.trial, refused=False, why=str(exc) if exc else f"HTTP {status}")
        elif exc is None:
            self.replica.health.success(self.trial)
        else:
            self.replica.health.cancel(self.trial)
