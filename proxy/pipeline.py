"""One request, top to bottom: read, plan, forward, relay through the observer, record, report.

::

    read body -> parse (wire API) -> plan (match, repair, diagnose; pure) -> forward
      -> relay (JSON or SSE, through the wire's observer) -> record -> report

Enrichment stages fail open (:mod:`proxy.failopen`): an error while planning,
observing or recording is logged and counted (``kvwarm_errors_total{stage}``) and
the request proceeds with the client's original bytes. Only the upstream itself
can fail a request. docs/ARCHITECTURE.md walks through this file.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aiohttp import web

from .config import Settings
from .core.identity import IdentityMemo
from .core.model import Node, TurnWrite
from .core.plan import TurnPlan, turn_write
from .core.policy import Policy
from .core.pricing import PriceTable, cost_of
from .core.usage import Usage
from .errors import ProxyError
from .failopen import FailOpen
from .guard import read_body
from .metrics import ProxyMetrics
from .relay import RelayOutcome, relay
from .report import Answer, BreakSink, Reporter, visibility_headers
from .routing import Lease, Replica, Route, Router
from .store.base import AsyncStore
from .tenancy import TenantRoots
from .tokens import TokenCounter
from .upstream import Upstream, forward_request_headers
from .wire.base import KEEP, Outgoing, Verdict, Wire
from .wire.chat import ChatWire
from .wire.responses import ResponsesWire

log = logging.getLogger(__name__)

INLINE_TOKENIZE_BYTES = 4096
"""New node bodies up to this many bytes in all are tokenized on the event loop (~0.1 ms);
larger ones in a worker thread."""
FILL_ROUNDS = 3
"""Most round trips to a shared store while planning one request."""

WIRES: tuple[Wire, ...] = (ChatWire(), ResponsesWire())


class Pipeline:
    """The stages, wired to the app's upstream, store, metrics and price table."""

    def __init__(
        self,
        settings: Settings,
        upstream: Upstream,
        store: AsyncStore,
        metrics: ProxyMetrics,
        prices: PriceTable,
        tokens: TokenCounter,
        breaks: BreakSink | None = None,
    ) -> None:
        self.settings = settings
        self.upstream = upstream
        self.store = store
        self.metrics = metrics
        self.prices = prices
        self.tokens = tokens
        self.reporter = Reporter(metrics, breaks)
        self.policy = Policy.build(
            repair=settings.repair.enabled,
            collapse_duplicates=settings.repair.collapse_duplicates,
            pin_patterns=settings.repair.pin_patterns,
        )
        self.tenants = TenantRoots(store.secret(), settings.store.tenant_header)
        self.memo = IdentityMemo()
        self.router = Router(settings.routing, upstream.senders, metrics)
        """Which replica takes each request; each replica keeps its own traits (:mod:`proxy.traits`)."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        guard = FailOpen(self.metrics.error)
        with self.metrics.inflight():
            raw = await read_body(request, self.settings.server)
            wire, body = None, None
            with guard("parse"):
                wire, body = self.parse(request, raw)
            if wire is None or body is None:
                return await self.passthrough(request, raw)
            answer = Answer(failed=guard.failed)
            plan: TurnPlan | None = None
            try:
                plan = await self.plan(request, wire, raw, body, guard)
                route = self.router.route(plan, body, guard)

                def outgoing(replica: Replica) -> Outgoing:  # the bytes depend on the replica's traits
                    out = Outgoing(raw, False)
                    with guard("repair"):
                        out = wire.outgoing(raw, body, plan, replica.traits)
                    return replace(out, body=route.keyed(out.body))

                lease = await self.send(request, route, outgoing, answer, started)
                observer = wire.observer(lease.outgoing, lease.replica.traits, guard, success=_ok(answer.status))

                async def finish(outcome: RelayOutcome) -> None:
                    answer.client_gone = outcome.client_gone
                    answer.reply = observer.end(client_gone=outcome.client_gone)
                    answer.usage = observer.usage
                    await self.record(plan, body, answer, guard)
                    with guard("routing"):
                        await lease.done(outcome)  # the replica's health; the recorded prefix lives there

                async with lease:
                    return await relay(request, lease.response, lease.sender, visibility_headers(plan), observer, finish)
            finally:
                with guard("report"):
                    self.reporter.report(
                        wire.name, _model(body), body.get("stream") is True, plan, answer, time.perf_counter() - started
                    )

    # -- the stages ---------------------------------------------------------------------------

    def parse(self, request: web.Request, raw: bytes) -> tuple[Wire | None, dict[str, Any] | None]:
        """The wire API that understands this request, and its parsed body."""
        for wire in WIRES:
            body = wire.parse(request.method, request.path, raw)
            if body is not None:
                return wire, body
        return None, None

    async def plan(
        self, request: web.Request, wire: Wire, raw: bytes, body: dict[str, Any], guard: FailOpen
    ) -> TurnPlan:
        """Plan against the store's view; a shared store is filled (bounded rounds, within budget) and planned again."""
        root = self.tenants.of(request.headers)
        view = self.store.view(root)
        plan = wire.plan(raw, body, root, view, self.policy, self.memo, guard)
        if view.missing or (self.store.shared and plan.match is not None):
            with guard("store"):
                async with asyncio.timeout(self.settings.store.timeout):
                    if plan.match is not None:
                        view.want(plan.match.keys, plan.match.identities)
                    for _ in range(FILL_ROUNDS):
                        if not await self.store.fill(view):
                            break
                        plan = wire.plan(raw, body, root, view, self.policy, self.memo, guard)
                        if not view.missing:
                            break
        return plan

    async def send(
        self, request: web.Request, route: Route, outgoing: Callable[[Replica], Outgoing], answer: Answer, started: float
    ) -> Lease[Outgoing]:
        """To the replica the route chooses (another one when it cannot be reached)."""
        headers = forward_request_headers(request.headers, self.settings.upstream.api_key)
        try:
            lease = await route.send(request.method, request.path, request.rel_url.raw_query_string, headers, outgoing)
        except ProxyError:
            self.metrics.error("upstream")
            raise
        answer.status = lease.response.status
        answer.ttfb = time.perf_counter() - started
        return lease

    async def passthrough(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        """A request no wire API understands: forwarded and relayed untouched, not observed."""
        lease = await self.send(request, self.router.route(None), lambda _: Outgoing(raw, False), Answer(), time.perf_counter())
        async with lease:
            return await relay(request, lease.response, lease.sender, {}, _Untouched(), lease.done)

    async def record(self, plan: TurnPlan | None, body: dict[str, Any], answer: Answer, guard: FailOpen) -> None:
        """Price the turn and store it, before the response's last bytes go out."""
        usage = answer.usage
        if usage is not None:
            with guard("usage"):
                answer.cost = cost_of(usage, self.prices.lookup(_model(body)))
        if plan is None or plan.match is None or not _ok(answer.status):
            return
        turn: TurnWrite | None = None
        with guard("record"):
            turn = turn_write(
                plan, answer.reply, usage, answer.cost,
                model=_model(body), client_gone=answer.client_gone, now=time.time(),
            )
        if turn is None:
            return
        with guard("record"):
            turn = await self.count_tokens(turn)
        # A local store's write is in-memory bookkeeping (a failure is the record's); a shared
        # store may be slow or gone (a failure is the store's).
        with guard("store" if self.store.shared else "record"):
            async with asyncio.timeout(self.settings.store.timeout):
                await self.store.write_turn(turn)

    async def count_tokens(self, turn: TurnWrite) -> TurnWrite:
        """Token counts of the turn's new nodes (their drafts carry byte lengths); a node the view
        already holds keeps its count. A local store gets only the nodes it lacks; a shared one all
        of them (its process cache may hold nodes the server lost: insert-if-absent sorts it out)."""
        view = self.store.view(turn.tenant)
        known = {n.key: view.get(n.key) for n in turn.nodes}
        new = [n for n in turn.nodes if known[n.key] is None]
        # CPU work: inline for a typical turn's few small messages, in a worker thread for a
        # first turn or a resume.
        if not new:
            counted: list[Node] = []
        elif sum(n.tokens for n in new) <= INLINE_TOKENIZE_BYTES:
            counted = self._count(new)
        else:
            counted = await asyncio.to_thread(self._count, new)
        if not self.store.shared:
            return replace(turn, nodes=tuple(counted))
        fresh = {n.key: n for n in counted}
        return replace(turn, nodes=tuple(known[n.key] or fresh[n.key] for n in turn.nodes))

    def _count(self, nodes: list[Node]) -> list[Node]:
        count = self.tokens.count_body
        return [replace(n, tokens=count(n.body)) for n in nodes]


class _Untouched:
    """The observer of a response kvwarm does not read."""

    usage: Usage | None = None

    def on_event(self, event: object) -> Verdict:
        return KEEP

    def is_terminal(self, event: object) -> bool:
        return False

    def on_body(self, chunk: bytes) -> None:
        return None

    def end(self, *, client_gone: bool) -> None:
        return None


def _ok(status: int | None) -> bool:
    return status is not None and 200 <= status < 300


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    return model if isinstance(model, str) else ""
