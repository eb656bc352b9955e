"""One request's exchange object: what came in, what was planned and sent, what came back.

A :class:`Turn` is made when a request arrives and filled step by step by
:meth:`proxy.request.pipeline.Pipeline.handle` (read, plan, send, relay, record, report), as mitmproxy's
flow is by its layers: each step reads what the steps before it found. :class:`Forward` is what
a turn goes upstream with, made for the replica that takes it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aiohttp import web

from ..core.plan import TurnPlan
from ..core.prefix import Recalled
from ..routing import Replica, Route
from ..wire.base import Observer, Outgoing, Untouched, Wire
from .diagnosis import asked
from .failopen import FailOpen
from .report import Answer

__all__ = ["Forward", "Scope", "Turn"]

Scope = tuple[bytes, str, str]
"""(tenant root, method, path): where a remembered body may be continued."""

_UNTOUCHED = Untouched()
"""The observer of a response kvwarm does not read (every turn's, until the relay step chooses)."""


class Turn:
    """One request on its way through kvwarm, from the client's bytes to its report."""

    __slots__ = (
        "answer", "body", "comparison", "guard", "model", "observer", "plan", "raw", "recalled", "request", "scope",
        "started", "wire",
    )

    def __init__(self, request: web.Request, guard: FailOpen, started: float) -> None:
        self.request = request
        """The client's request."""
        self.guard = guard
        """This request's fail-open boundary: the stages that failed open (the log line's ``failed_open=``)."""
        self.started = started
        """``time.perf_counter()`` when the request arrived: its duration and time to first byte."""
        self.raw = b""
        """The client's body, as it arrived."""
        self.scope: Scope = (b"", request.method, request.path)
        """(tenant root, method, path): where a remembered body may be continued."""
        self.wire: Wire | None = None
        """The wire API that understood the body; None: none did, the request is forwarded
        untouched and not observed (nor planned, recorded or reported)."""
        self.body: dict[str, Any] | None = None
        """The parsed body (None with no wire)."""
        self.recalled: Recalled | None = None
        """The tenant's recent body this one continues: its parse was reused (:mod:`proxy.core.prefix`)."""
        self.model = ""
        """The body's ``model`` (``""`` when it names none)."""
        self.plan: TurnPlan | None = None
        """Match, repair and break (:func:`~proxy.core.plan.plan_turn`); None: not planned."""
        self.comparison: str | None = None
        """The earlier response the provider is asked to compare this request's cache use with
        (:mod:`proxy.request.diagnosis`); None: kvwarm asks nothing."""
        self.observer: Observer = _UNTOUCHED
        """The wire's reading of the response: the usage, the reply as generated."""
        self.answer = Answer(failed=guard.failed)
        """What came back: status, time to first byte, usage, reply, cost."""

    @property
    def root(self) -> bytes:
        """The tenant root: the chain of every node of this tenant starts from it."""
        return self.scope[0]

    @property
    def answered(self) -> bool:
        """The upstream answered with a 2xx status (an answer to observe and record)."""
        status = self.answer.status
        return status is not None and 200 <= status < 300


class Forward:
    """What a turn goes upstream with (:class:`~proxy.routing.router.Payload`): the wire's bytes
    for the replica's traits (the repaired body; for chat streams, ``include_usage`` unless the
    replica reports llama.cpp ``timings``), with the route's ``prompt_cache_key`` and the turn's
    comparison (:mod:`proxy.request.diagnosis`). A repair that cannot be written fails open: the client's
    bytes; so does a comparison: the bytes without it."""

    __slots__ = ("body", "comparison", "guard", "plan", "raw", "route", "wire")

    def __init__(self, turn: Turn, route: Route) -> None:
        self.raw = turn.raw
        self.wire = turn.wire
        self.body = turn.body
        self.plan = turn.plan
        self.guard = turn.guard
        self.route = route
        self.comparison = turn.comparison

    def for_replica(self, replica: Replica) -> Outgoing:
        wire, body, plan = self.wire, self.body, self.plan
        if wire is None or body is None or plan is None:
            return Outgoing(body=self.raw, usage_injected=False)
        try:
            out = wire.outgoing(self.raw, body, plan, replica.traits)
        except Exception as exc:
            self.guard.fail("repair", exc)
            out = Outgoing(body=self.raw, usage_injected=False)
        keyed = self.route.keyed(out.body)
        if self.comparison is not None:
            try:
                keyed = asked(wire.name, keyed, body, self.comparison)
            except Exception as exc:
                self.guard.fail("diagnostics", exc)
        return out if keyed is out.body else replace(out, body=keyed)
