"""One request, top to bottom: read, plan, forward, relay through the observer, record, report.

::

    read body -> parse (wire API) -> plan (match, repair, diagnose; pure) -> forward
      -> relay (JSON or SSE, through the wire's observer) -> record -> report

Enrichment stages fail open (:mod:`proxy.failopen`): an error while planning,
observing or recording is logged and counted (``kvwarm_errors_total{stage}``) and
the request proceeds with the client's original bytes. Only the upstream itself
can fail a request: before its response or during it, that is counted as the upstream's
(``stage="upstream"``) and logged as one WARNING line. docs/ARCHITECTURE.md walks through
this file.

Before the response's last byte only what it needs is done: the plan (its headers and
bytes), the relay, and the turn's write to the store. After it (at the end of the event
loop's iteration, in batches with every request answered meanwhile): the metrics and the log
line (:class:`~proxy.report.Reporter`), and the body's layout for the next turn: a
conversation re-sent byte for byte is parsed and identified only past what it shares with its
previous body (:mod:`proxy.core.prefix`). Token counts (tiktoken, 60-170 µs per KiB) are made
when they are read (a repair's rescued tokens, a session's view) with a local store; a shared
store has a turn's nodes counted before the write (small ones inline, large ones in a worker
thread).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from aiohttp import web

from .config import Settings
from .core.identity import IdentityMemo
from .core.model import Node, NodeReader, TurnWrite
from .core.plan import TurnPlan, turn_write
from .core.prefix import PrefixMemo, Recalled
from .core.pricing import PriceTable, cost_of
from .core.transcript_md import Transcript
from .errors import ProxyError
from .failopen import FailOpen
from .guard import shown_path
from .metrics import ProxyMetrics
from .relay import Finish, RelayOutcome, relay
from .report import Answer, BreakSink, Reporter, visibility_headers
from .routing import Lease, Replica, Route, Router
from .store.base import AsyncStore, StoreView
from .store.local import LocalStore
from .tenancy import TenantRoots
from .tokens import TokenCounter
from .upstream import Upstream, forward_request_headers
from .wire.base import Observer, Outgoing, Untouched, Wire
from .wire.chat import ChatWire
from .wire.responses import ResponsesWire

log = logging.getLogger(__name__)

INLINE_TOKENIZE_BYTES = 4096
"""Node bodies up to this many bytes in all are tokenized on the event loop (0.3-0.7 ms); larger
ones in a worker thread."""
LATER = -2
"""The token count of a node written uncounted, filled in when read
(:attr:`~proxy.store.local.LocalStore.fills_tokens`)."""
FILL_ROUNDS = 3
"""Most round trips to a shared store while planning one request."""

WIRES: tuple[Wire, ...] = (ChatWire(), ResponsesWire())
Scope = tuple[bytes, str, str]
"""(tenant root, method, path): where a remembered body may be continued."""


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
        self.policy = settings.repair.policy()
        self.tenants = TenantRoots(store.secret, settings.store.tenant_header, shared=store.shared)
        self.memo = IdentityMemo()
        self.resent = PrefixMemo(self.memo)
        """Each tenant's recent bodies: a re-sent conversation is parsed only past what it shares."""
        self._counting: dict[bytes, asyncio.Future[int]] = {}
        """Node key -> its token count being computed in a worker thread by some request."""
        self._fill_later = isinstance(store, LocalStore) and store.fills_tokens
        """Nodes are written uncounted and counted when something reads their counts."""
        self.router = Router(settings.routing, upstream.senders, metrics)
        """Which replica takes each request; each replica keeps its own traits (:mod:`proxy.traits`)."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        guard = FailOpen(self.metrics.error)
        self.metrics.request_began()
        try:
            raw = await request.read()  # read by the guard middleware, within its size and time limits
            scope: Scope = (self.tenants.of(request.headers), request.method, request.path)
            wire, body, recalled = None, None, None
            # Every request's stages: try/except, the guard's boundary at no cost (core/guard.py).
            try:
                wire, body, recalled = self.parse(request, raw, scope)
            except Exception as exc:
                guard.fail("parse", exc)
            if wire is None or body is None:
                return await self.passthrough(request, raw)
            answer = Answer(failed=guard.failed)
            model = _model(body)
            plan: TurnPlan | None = None
            try:
                plan, view = self.plan(wire, raw, body, scope[0], guard, recalled)
                if view.missing or (self.store.shared and plan.match is not None):
                    plan = await self.fill(wire, raw, body, scope[0], guard, plan, view)
                if self._fill_later and plan.repair.repairs:
                    with guard("repair"):
                        plan = await self.exact_rescue(plan, view)
                route = self.router.route(plan, body, guard)

                def outgoing(replica: Replica) -> Outgoing:  # the bytes depend on the replica's traits
                    try:
                        out = wire.outgoing(raw, body, plan, replica.traits)
                    except Exception as exc:
                        guard.fail("repair", exc)
                        out = Outgoing(raw, False)
                    keyed = route.keyed(out.body)
                    return out if keyed is out.body else replace(out, body=keyed)

                lease = await self.send(request, route, outgoing, answer, started)
                answered = _ok(answer.status)
                observer = wire.observer(lease.outgoing, lease.replica.traits, guard, success=answered)

                async def finish(outcome: RelayOutcome) -> None:
                    if outcome.upstream_error is not None:
                        self.upstream_broke(request, outcome.upstream_error)
                    answer.client_gone = outcome.client_gone
                    answer.reply = observer.end(client_gone=outcome.client_gone)
                    answer.usage = observer.usage
                    await self.record(plan, model, answer, guard, answered)
                    try:
                        await lease.done(outcome)  # the replica's health; the recorded prefix lives there
                    except Exception as exc:
                        guard.fail("routing", exc)

                with lease:
                    return await self.relay_lease(request, lease, visibility_headers(plan), observer, finish, answer)
            finally:
                duration = time.perf_counter() - started
                # After the response (the end of this loop iteration), before the client's next turn.
                asyncio.get_running_loop().call_soon(self.remember, scope, wire, raw, body, plan, recalled, guard)
                try:
                    self.reporter.report(wire.name, model, body.get("stream") is True, plan, answer, duration)
                except Exception as exc:
                    guard.fail("report", exc)
        finally:
            self.metrics.request_ended()

    # -- the stages ---------------------------------------------------------------------------

    def parse(
        self, request: web.Request, raw: bytes, scope: Scope
    ) -> tuple[Wire | None, dict[str, Any] | None, Recalled | None]:
        """The wire API that understands this request, and its parsed body: a conversation that
        continues one of the tenant's recent bodies is parsed only past what they share."""
        recalled = self.resent.recall(scope, raw)
        if recalled is not None:
            return recalled.tag, recalled.body, recalled
        for wire in WIRES:
            body = wire.parse(request.method, request.path, raw)
            if body is not None:
                return wire, body, None
        return None, None, None

    def remember(
        self,
        scope: Scope,
        wire: Wire,
        raw: bytes,
        body: dict[str, Any],
        plan: TurnPlan | None,
        recalled: Recalled | None,
        guard: FailOpen,
    ) -> None:
        """Keep the body, where its messages are and what they are, for the tenant's next turn."""
        if plan is not None and plan.match is not None and wire.resends is not None:
            try:
                self.resent.remember_plan(scope, raw, body, plan, recalled, tag=wire, array=wire.resends)
            except Exception as exc:
                guard.fail("identify", exc)

    def plan(
        self, wire: Wire, raw: bytes, body: dict[str, Any], root: bytes, guard: FailOpen, recalled: Recalled | None
    ) -> tuple[TurnPlan, StoreView]:
        """Plan against the store's view (complete for a local store; a shared one may then be
        filled, :meth:`fill`)."""
        view = self.store.view(root)
        # A local store keeps a node's parents while it keeps the node: the match of a re-sent
        # conversation's shared messages holds as long as its deepest node is stored.
        return wire.plan(raw, body, root, view, self.policy, self.memo, guard, None if self.store.shared else recalled), view

    async def fill(
        self, wire: Wire, raw: bytes, body: dict[str, Any], root: bytes, guard: FailOpen, plan: TurnPlan, view: StoreView
    ) -> TurnPlan:
        """Fill a shared store's view with what the plan looked up (bounded rounds, within budget)
        and plan again."""
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

        async def finish(outcome: RelayOutcome) -> None:
            if outcome.upstream_error is not None:
                self.upstream_broke(request, outcome.upstream_error)
            await lease.done(outcome)

        with lease:
            return await self.relay_lease(request, lease, {}, Untouched(), finish)

    async def relay_lease(
        self,
        request: web.Request,
        lease: Lease[Outgoing],
        headers: dict[str, str],
        observer: Observer,
        finish: Finish,
        answer: Answer | None = None,
    ) -> web.StreamResponse:
        """The lease's response to the client through ``observer``. An upstream that fails before
        a byte of it was sent (a body read whole, cut short) is counted here as the upstream's
        failure, and the request's status is an error (no response came back whole); the edge
        answers 502 and logs it."""
        try:
            return await relay(request, lease.response, lease.sender, headers, observer, finish)
        except ProxyError:
            self.metrics.error("upstream")
            if answer is not None:
                answer.status = None
            raise

    def upstream_broke(self, request: web.Request, error: ProxyError) -> None:
        """The upstream failed after its response began (cut short, stalled): the client's
        response breaks as the upstream's did. The failure is the upstream's: counted as one
        before the response is (``kvwarm_errors_total{stage="upstream"}``) and logged as one
        WARNING line without a traceback, never as an error of kvwarm's own stages."""
        self.metrics.error("upstream")
        log.warning("%s %s: the response was cut: %s", request.method, shown_path(request), error)

    async def record(self, plan: TurnPlan | None, model: str, answer: Answer, guard: FailOpen, answered: bool) -> None:
        """Price the turn and store it (``answered``: with a 2xx status), before the response's
        last bytes go out."""
        usage = answer.usage
        if usage is not None:
            try:
                answer.cost = cost_of(usage, self.prices.lookup(model))
            except Exception as exc:
                guard.fail("usage", exc)
        if plan is None or plan.match is None or not answered:
            return
        try:
            turn = turn_write(
                plan, answer.reply, usage, answer.cost,
                model=model, client_gone=answer.client_gone, now=time.time(),
                count_tokens=_uncounted if self._fill_later else _TokenBudget(self.tokens.count_body, INLINE_TOKENIZE_BYTES),
                memo=self.memo,
            )
        except Exception as exc:
            guard.fail("record", exc)
            return
        if turn is None:
            return
        if not self._fill_later and any(n.tokens == -1 for n in turn.nodes):
            with guard("record"):
                turn = await self.count_large(turn)
        store = self.store
        if not store.shared:
            # A local store's write is in-memory bookkeeping that never waits: a failure is the record's.
            try:
                if isinstance(store, LocalStore):
                    store.write_turn_now(turn)
                else:
                    await store.write_turn(turn)
            except Exception as exc:
                guard.fail("record", exc)
            return
        with guard("store"):  # a shared store may be slow or gone
            async with asyncio.timeout(self.settings.store.timeout):
                await self.store.write_turn(turn)

    async def count_large(self, turn: TurnWrite) -> TurnWrite:
        """Token counts of the nodes left uncounted (-1) past the inline budget: a first turn's
        system prompt, a large tool result (:meth:`counts`)."""
        nodes = await self.counted(turn.nodes, turn.tenant)
        return turn if nodes is None else replace(turn, nodes=nodes)

    async def counted_transcript(self, transcript: Transcript) -> Transcript:
        """``transcript`` with every node's token count: those written uncounted are counted now."""
        nodes = await self.counted(transcript.nodes, transcript.tenant)
        return transcript if nodes is None else replace(transcript, nodes=nodes)

    async def counted(self, nodes: Sequence[Node], tenant: bytes) -> tuple[Node, ...] | None:
        """``nodes`` with those written uncounted counted (:meth:`counts`); None: all were counted."""
        later = [n for n in nodes if n.tokens < 0]
        if not later:
            return None
        counts = await self.counts(later, self.store.view(tenant))
        return tuple(n.with_tokens(counts[n.key]) if n.tokens < 0 else n for n in nodes)

    async def counts(self, nodes: Sequence[Node], view: NodeReader) -> dict[bytes, int]:
        """Key -> token count of each of ``nodes``: as written or as stored, else counted once.
        CPU work: on the event loop within :data:`INLINE_TOKENIZE_BYTES`, beyond in a worker
        thread; a node that another request is counting now (parallel requests of one new
        conversation) is waited for. Counts made are filled into a local store that keeps them."""
        counts: dict[bytes, int] = {}
        waits: dict[bytes, asyncio.Future[int]] = {}
        mine: list[Node] = []
        for node in nodes:
            stored = node if node.tokens >= 0 else view.get(node.key)
            if stored is not None and stored.tokens >= 0:
                counts[node.key] = stored.tokens
            elif node.key in self._counting:
                waits[node.key] = self._counting[node.key]
            else:
                mine.append(node)
        if mine and sum(len(n.body) for n in mine) <= INLINE_TOKENIZE_BYTES:
            counts.update(zip((n.key for n in mine), self._count([n.body for n in mine]), strict=True))
        elif mine:
            loop = asyncio.get_running_loop()
            futures = {node.key: loop.create_future() for node in mine}
            self._counting.update(futures)
            try:
                counted = await asyncio.to_thread(self._count, [node.body for node in mine])
                counts.update(zip(futures, counted, strict=True))
            finally:
                for key, future in futures.items():
                    future.set_result(counts.get(key, -1))  # -1: failed, a waiter counts it itself
                    del self._counting[key]
        for key, future in waits.items():
            counts[key] = await asyncio.shield(future)
        missing = [node for node in nodes if counts.get(node.key, -1) < 0]
        if missing:
            counts.update(zip((n.key for n in missing), await asyncio.to_thread(self._count, [n.body for n in missing]), strict=True))
        if mine and self._fill_later and isinstance(self.store, LocalStore):
            self.store.fill_tokens({n.key: counts[n.key] for n in mine})
        return counts

    def _count(self, bodies: list[bytes]) -> list[int]:
        count = self.tokens.count_body
        return [count(body) for body in bodies]

    async def exact_rescue(self, plan: TurnPlan, view: NodeReader) -> TurnPlan:
        """A repaired plan whose rescued tokens count nodes written uncounted gets them counted
        (:meth:`counts`): ``rescued_tokens`` is exact."""
        repair, match = plan.repair, plan.match
        if not repair.repairs or match is None:
            return plan
        nodes = match.nodes[min(r.depth for r in repair.repairs) :]
        if all(n.tokens >= 0 for n in nodes):
            return plan
        counts = await self.counts(nodes, view)
        return replace(plan, repair=replace(repair, rescued_tokens=sum(counts[n.key] for n in nodes)))


class _TokenBudget:
    """Token counts while the bodies counted stay within ``budget`` bytes in all, on the event
    loop; -1 beyond (counted in a worker thread before the turn is written)."""

    __slots__ = ("_count", "_left")

    def __init__(self, count: Callable[[bytes], int], budget: int) -> None:
        self._count = count
        self._left = budget

    def __call__(self, body: bytes) -> int:
        self._left -= len(body)
        if self._left < 0:
            return -1
        return self._count(body)


def _uncounted(body: bytes) -> int:
    """The count of a node written to a store that fills counts in when read."""
    return LATER


def _ok(status: int | None) -> bool:
    return status is not None and 200 <= status < 300


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    return model if isinstance(model, str) else ""
