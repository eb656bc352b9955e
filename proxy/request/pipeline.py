"""One request, top to bottom: read, plan, send, relay through the observer, record, report.

::

    read body -> parse (wire API) -> plan (match, repair, diagnose; pure) -> send
      -> relay (JSON or SSE, through the wire's observer) -> record -> last bytes -> report

:meth:`Pipeline.handle` calls the steps in this order on one :class:`~proxy.request.turn.Turn`, the
request's exchange object, which each step reads and fills in. Nothing calls back into the
pipeline: the router returns a lease on the replica's response, the relay returns how the
response ended before its last bytes (:class:`~proxy.request.relay.Relay`), and the turn is recorded
in between. docs/ARCHITECTURE.md walks through this file.

Enrichment stages fail open (:mod:`proxy.request.failopen`): an error while planning,
observing or recording is logged and counted (``kvwarm_errors_total{stage}``) and
the request proceeds with the client's original bytes. Only the upstream itself
can fail a request: before its response or during it, that is counted as the upstream's
(``stage="upstream"``) and logged as one WARNING line.

Before the response's last byte only what it needs is done: the plan (its headers and
bytes), the relay, and the turn's write to the store. After it (at the end of the event
loop's iteration, in batches with every request answered meanwhile): the metrics and the log
line (:class:`~proxy.request.report.Reporter`), and the body's layout for the next turn: a
conversation re-sent byte for byte is parsed and identified only past what it shares with its
previous body (:class:`~proxy.request.parser.Parser`, :mod:`proxy.core.prefix`). Token counts are made as the store keeps them
(:meth:`~proxy.store.base.AsyncStore.token_counts`, :mod:`proxy.store.tokens`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..config import Settings
from ..core.breakpoints import OFF, dialect_of, host_rule, tree_facts
from ..core.identity import IdentityMemo
from ..core.plan import TurnPlan, turn_write
from ..core.pricing import PriceTable, cost_of
from ..core.transcript_md import Transcript
from ..edge.defences import shown_path
from ..edge.tenancy import TenantRoots
from ..errors import ProxyError
from ..metrics import ProxyMetrics
from ..routing import Lease, Router
from ..store.base import AsyncStore, StoreView
from ..store.tokens import TokenCounter
from ..transport.client import Upstream, forward_request_headers
from ..wire.base import Outgoing, Wire
from .diagnosis import ProviderDiagnosis, verdict_of
from .failopen import FailOpen
from .parser import Parser
from .relay import Relay, RelayOutcome
from .report import BreakSink, Reporter, visibility_headers
from .turn import Forward, Turn

if TYPE_CHECKING:  # the keep-alive imports the edge modules the app imports
    from ..keepalive import KeepAlive

log = logging.getLogger(__name__)

FILL_ROUNDS = 3
"""Most round trips to a shared store while planning one request."""


class Pipeline:
    """The steps of a request, wired to the app's upstream, store, metrics and price table."""

    def __init__(
        self, settings: Settings, upstream: Upstream, store: AsyncStore, metrics: ProxyMetrics,
        prices: PriceTable, counter: TokenCounter, breaks: BreakSink | None = None,
    ) -> None:
        self.settings = settings
        self.upstream = upstream
        self.store = store
        self.metrics = metrics
        self.prices = prices
        self.tokens = store.token_counts(counter)
        """Token counts of the store's nodes, made when and as the store keeps them."""
        self.reporter = Reporter(metrics, breaks)
        self.keepalive: KeepAlive | None = None
        """Keeps paused sessions' cached prefixes warm (:mod:`proxy.keepalive`; the app sets it when
        enabled): told of each recorded turn, O(1)."""
        self.policy = settings.repair.policy()
        self.tenants = TenantRoots(store.secret, settings.store.tenant_header, shared=store.shared)
        self.memo = IdentityMemo()
        self.parser = Parser(self.memo)
        """The wire API of each request and its body, parsed only past what a re-sent conversation
        shares with the tenant's recent bodies (:mod:`proxy.request.parser`)."""
        self.router = Router(settings.routing, upstream.senders, metrics)
        """Which replica takes each request; each replica keeps its own traits (:mod:`proxy.transport.traits`)."""
        for replica in self.router.replicas:
            replica.traits.cache_breakpoints = host_rule(settings.upstream.cache_breakpoints, replica.base_url)
        self.marker_rules = frozenset(r.traits.cache_breakpoints for r in self.router.replicas) - {OFF}
        """The pool's cache-marker rules but ``off`` (:mod:`proxy.core.breakpoints`): a request
        whose model one of them marks has what the tree knows looked up while planning."""
        self.diagnosis = ProviderDiagnosis(settings.upstream.provider_diagnostics)
        """Which earlier response the provider compares each request with (:mod:`proxy.request.diagnosis`)."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One request, step by step (docs/ARCHITECTURE.md, "The request path")."""
        turn = Turn(request, FailOpen(self.metrics.error), time.perf_counter())
        self.metrics.request_began()
        try:
            await self.read(turn)
            await self.plan(turn)
            with await self.send(turn) as lease:
                relay = await self.relay(turn, lease)  # the response but its last bytes
                await self.record(turn, lease, relay.outcome)  # before the last byte
                return await relay.end()  # the last bytes
        finally:
            self.report(turn)
            self.metrics.request_ended()

    # -- the steps, in order ------------------------------------------------------------------

    async def read(self, turn: Turn) -> None:
        """The body (read by the edge middleware, within its size and time limits), the tenant,
        and the wire API that understands the body with its parse (none: forwarded untouched)."""
        request = turn.request
        turn.raw = await request.read()
        turn.scope = (self.tenants.of(request.headers), request.method, request.path)
        # Every request's stages: try/except, the guard's boundary at no cost (core/guard.py).
        try:
            turn.wire, turn.body, turn.recalled = self.parser.parse(request, turn.raw, turn.scope)
        except Exception as exc:
            turn.guard.fail("parse", exc)
        if turn.body is not None:
            model = turn.body.get("model")
            turn.model = model if isinstance(model, str) else ""

    async def plan(self, turn: Turn) -> None:
        """Match, repair and diagnose against the store's view (complete for a local store; a
        shared one's is filled, :meth:`fill`); a repair's rescued tokens are counted exactly."""
        wire, body = turn.wire, turn.body
        if wire is None or body is None:
            return
        store, root = self.store, turn.root
        view = store.view(root)
        # A local store keeps a node's parents while it keeps the node: the match of a re-sent
        # conversation's shared messages holds as long as its deepest node is stored.
        recalled = None if store.shared else turn.recalled
        plan = wire.plan(turn.raw, body, root, view, self.policy, self.memo, turn.guard, recalled)
        if view.missing or (store.shared and plan.match is not None):
            plan = await self.fill(turn, wire, body, plan, view)
        if plan.repair.repairs:
            with turn.guard("repair"):
                plan = await self.tokens.exact_rescue(plan, view)
        if self.marker_rules and plan.match is not None and any(dialect_of(r, turn.model) for r in self.marker_rules):
            with turn.guard("breakpoints"):
                plan = plan.with_tree(tree_facts(plan.match, view))
        turn.plan = plan
        if self.diagnosis.enabled:
            with turn.guard("diagnostics"):
                turn.comparison = self.diagnosis.comparison(wire.name, body, plan)

    async def fill(self, turn: Turn, wire: Wire, body: dict[str, Any], plan: TurnPlan, view: StoreView) -> TurnPlan:
        """Fill a shared store's view with what the plan looked up (bounded rounds, within budget)
        and plan again."""
        with turn.guard("store"):
            async with asyncio.timeout(self.settings.store.timeout):
                if plan.match is not None:
                    view.want(plan.match.keys, plan.match.identities)
                for _ in range(FILL_ROUNDS):
                    if not await self.store.fill(view):
                        break
                    plan = wire.plan(turn.raw, body, turn.root, view, self.policy, self.memo, turn.guard)
                    if not view.missing:
                        break
        return plan

    async def send(self, turn: Turn) -> Lease[Outgoing]:
        """To the replica the route chooses (the next one while the request was never sent), with
        the bytes made for that replica (:class:`~proxy.request.turn.Forward`)."""
        request = turn.request
        route = self.router.route(turn.plan, turn.body, turn.guard)
        headers = forward_request_headers(request.headers, self.settings.upstream.api_key)
        try:
            lease = await route.send(request.method, request.path, request.rel_url.raw_query_string, headers, Forward(turn, route))
        except ProxyError:
            self.metrics.error("upstream")
            raise
        turn.answer.status = lease.response.status
        turn.answer.ttfb = time.perf_counter() - turn.started
        marks = turn.answer.marks = lease.outgoing.marks
        if marks is not None and marks.error is not None:
            turn.guard.fail("breakpoints", marks.error)  # sent without markers
        return lease

    async def relay(self, turn: Turn, lease: Lease[Outgoing]) -> Relay:
        """The response but its last bytes, after the report headers, through the wire's observer
        (:meth:`Relay.run`). An upstream failing before a byte was sent is counted as its failure
        (no response came back whole: the edge answers 502); a client that leaves mid-response
        still has what it was delivered recorded, shielded from the cancellation."""
        wire, plan = turn.wire, turn.plan
        headers: dict[str, str] = {}
        if wire is not None and plan is not None:
            turn.observer = wire.observer(lease.outgoing, lease.replica.traits, turn.guard, success=turn.answered)
            headers = visibility_headers(plan, turn.answer.marks)
        relay = Relay(turn.request, lease.response, lease.sender, headers, turn.observer)
        try:
            await relay.run()
        except ProxyError:
            self.metrics.error("upstream")
            turn.answer.status = None
            raise
        except asyncio.CancelledError:
            if relay.outcome.client_gone:
                await asyncio.shield(self.record(turn, lease, relay.outcome))
            raise
        return relay

    async def record(self, turn: Turn, lease: Lease[Outgoing], outcome: RelayOutcome) -> None:
        """Before the response's last bytes: the reply and usage as observed, the turn priced and
        stored, then the replica's health and (answered) where the turn's prefix lives."""
        if outcome.upstream_error is not None:
            self.upstream_broke(turn.request, outcome.upstream_error)
        if turn.wire is not None:
            answer = turn.answer
            answer.client_gone = outcome.client_gone
            answer.reply = turn.observer.end(client_gone=outcome.client_gone)
            answer.usage = turn.observer.usage
            answer.verdict = verdict_of(turn.observer)
            self.price(turn)
            await self.store_turn(turn)
        try:
            await lease.done(outcome)  # after the write: the recorded prefix lives on that replica
        except Exception as exc:
            turn.guard.fail("routing", exc)
        keepalive = self.keepalive
        if keepalive is not None and turn.wire is not None:
            try:
                keepalive.note(turn, lease.replica, lease.outgoing.body)
            except Exception as exc:
                turn.guard.fail("keepalive", exc)

    def report(self, turn: Turn) -> None:
        """After the response (queued to the end of this event-loop iteration, before the client's
        next turn): the body kept for the tenant's next turn, the metrics, the log line."""
        wire, body = turn.wire, turn.body
        if wire is None or body is None:
            return
        duration = time.perf_counter() - turn.started
        asyncio.get_running_loop().call_soon(self.parser.remember, turn)
        try:
            self.reporter.report(wire.name, turn.model, body.get("stream") is True, turn.plan, turn.answer, duration)
        except Exception as exc:
            turn.guard.fail("report", exc)

    # -- what the steps share -----------------------------------------------------------------

    def upstream_broke(self, request: web.Request, error: ProxyError) -> None:
        """The upstream failed mid-response (cut short, stalled): the client's response breaks as
        its did, counted as the upstream's failure and logged as one WARNING line, never as kvwarm's."""
        self.metrics.error("upstream")
        log.warning("%s %s: the response was cut: %s", request.method, shown_path(request), error)

    def price(self, turn: Turn) -> None:
        """The turn's cost: the provider's bill, else the price table's (failing open: unknown)."""
        usage = turn.answer.usage
        if usage is not None:
            try:
                turn.answer.cost = cost_of(usage, self.prices.lookup(turn.model))
            except Exception as exc:
                turn.guard.fail("usage", exc)

    async def store_turn(self, turn: Turn) -> None:
        """The turn's new nodes and the session's totals, written (a matched request answered 2xx)."""
        plan, answer, guard = turn.plan, turn.answer, turn.guard
        if plan is None or plan.match is None or not turn.answered:
            return
        try:
            write = turn_write(
                plan, answer.reply, answer.usage, answer.cost,
                model=turn.model, client_gone=answer.client_gone, now=time.time(),
                count_tokens=self.tokens.for_write(), memo=self.memo,
            )
        except Exception as exc:
            guard.fail("record", exc)
            return
        if write is None:
            return
        if self.diagnosis.enabled:
            with guard("diagnostics"):
                self.diagnosis.remember(write.leaf, turn.observer)
        try:
            write = await self.tokens.counted_turn(write)
        except Exception as exc:
            guard.fail("record", exc)
        store = self.store
        if not store.shared:
            # A local store's write is in-memory bookkeeping that never waits: a failure is the record's.
            try:
                await store.write_turn(write)
            except Exception as exc:
                guard.fail("record", exc)
            return
        with guard("store"):  # a shared store may be slow or gone
            async with asyncio.timeout(self.settings.store.timeout):
                await store.write_turn(write)

    async def counted_transcript(self, transcript: Transcript) -> Transcript:
        """``transcript`` with every node's token count: those written uncounted are counted now."""
        return await self.tokens.counted_transcript(transcript)
