"""Reporting one request: the ``x-kvwarm-*`` response headers, the metrics, the INFO log line.

Everything a request tells the outside world about itself is written here, from
the request's frozen plan and its :class:`Answer`:

``x-kvwarm-prefix: matched=12/14; repaired=3; rescued=5120; break=content_changed@13; breakpoints=2``
    ``matched`` counts leading messages found in the store out of the request's
    messages (the ``tools`` array is element 0 and not counted); ``break`` names the
    reason and the message index (``tools`` for the tools array); ``breakpoints`` the cache
    markers kvwarm added (:mod:`proxy.core.breakpoints`; absent where the upstream takes none).
``x-kvwarm-break: content_changed at messages[0] offset=.. length=.. shape=.. hint=..``
    The changed span by shape only, never the client's text.

The log line carries no prompt text and no credential.

The provider's own verdict on the response's cache use (``upstream.provider_diagnostics``,
:mod:`proxy.request.diagnosis`) comes with the response, after these headers went out: it is in the
metrics and the log line (``provider=hit``, ``provider=client:input_changed``,
``provider=provider:expired``), never in a header. Read with ``break=``: a break is the client's
drift kvwarm could not repair; ``provider=provider:...`` without one is a prefix the provider lost.

The headers go out with the response; the rest of a request's report is written after it:
:meth:`Reporter.report` queues it, and the queue is written at the end of the event loop's
iteration (after the response's last byte), or by any read of the metrics first
(:meth:`ProxyMetrics.flush` runs :meth:`Reporter.flush`), so a scrape right after a
response sees it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..core.breakpoints import Marks
from ..core.plan import TurnPlan
from ..core.pricing import Cost
from ..core.provider_misses import CacheVerdict
from ..core.record import Reply
from ..core.usage import Usage
from ..metrics import ProxyMetrics
from .failopen import FailOpen

log = logging.getLogger("proxy.request.pipeline")

__all__ = ["BREAK_HEADER", "PREFIX_HEADER", "Answer", "Reporter", "visibility_headers"]

PREFIX_HEADER = "x-kvwarm-prefix"
BREAK_HEADER = "x-kvwarm-break"


@dataclass(init=False)  # a compiled record (proxy/core/values.py)
class Answer:
    """What came back for one request, filled while the response is relayed."""

    status: int | None = None
    """Upstream status (None when the upstream could not be reached)."""
    ttfb: float | None = None
    """Seconds from arrival to the upstream's response headers."""
    usage: Usage | None = None
    reply: Reply | None = None
    """The reply as generated (as delivered, when the client left mid-stream)."""
    cost: Cost | None = None
    client_gone: bool = False
    failed: Sequence[str] = ()
    """Stages that failed open (the request's fail-open guard's list)."""
    marks: Marks | None = None
    """The cache markers kvwarm placed on the request sent (None: the upstream takes none)."""
    verdict: CacheVerdict | None = None
    """The provider's verdict on the response's cache use (None: it gave none)."""

    def __init__(
        self,
        *,
        status: int | None = None,
        ttfb: float | None = None,
        usage: Usage | None = None,
        reply: Reply | None = None,
        cost: Cost | None = None,
        client_gone: bool = False,
        failed: Sequence[str] = (),
        marks: Marks | None = None,
        verdict: CacheVerdict | None = None,
    ) -> None:
        self.status = status
        self.ttfb = ttfb
        self.usage = usage
        self.reply = reply
        self.cost = cost
        self.client_gone = client_gone
        self.failed = failed
        self.marks = marks
        self.verdict = verdict


class BreakSink(Protocol):
    """Keeps examples of breaks (the live page's ``Activity``)."""

    def note_break(self, tenant: bytes, reason: str, where: str, shape: str, hint: str, now: float) -> None: ...


_Report = tuple[str, str, bool, "TurnPlan | None", Answer, float]
"""(api, model, stream, plan, answer, duration) of one request, queued."""


class Reporter:
    """Writes the metrics and the log line of each request, after its response."""

    def __init__(self, metrics: ProxyMetrics, breaks: BreakSink | None = None) -> None:
        self.metrics = metrics
        self.breaks = breaks
        self._count_error = metrics.error
        """Counts a failed report (bound once: a report failure must not depend on what failed)."""
        self._queue: list[_Report] = []
        self._scheduled = False
        metrics.before_flush(self.flush)

    def report(self, api: str, model: str, stream: bool, plan: TurnPlan | None, answer: Answer, duration: float) -> None:
        """Queue one request's report (``answer`` is final); written at the end of this event-loop
        iteration, at once when there is no running loop."""
        self._queue.append((api, model, stream, plan, answer, duration))
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        loop.call_soon(self.flush)
        self._scheduled = True

    def flush(self) -> None:
        """Write every queued report."""
        self._scheduled = False
        if not self._queue:
            return
        queue, self._queue = self._queue, []
        guard = FailOpen(self._count_error)
        for api, model, stream, plan, answer, duration in queue:
            try:
                self._write(api, model, stream, plan, answer, duration)  # (a native call; ``*item`` is not)
            except Exception as exc:
                guard.fail("report", exc)

    def _write(self, api: str, model: str, stream: bool, plan: TurnPlan | None, answer: Answer, duration: float) -> None:
        m = self.metrics
        marks = answer.marks
        m.observe_request(
            model=model, status=answer.status, stream=stream, duration=duration,
            ttfb=answer.ttfb, usage=answer.usage, cost=answer.cost,
            rescued_tokens=plan.repair.rescued_tokens if plan is not None else 0,
            breakpoint_reads=marks is not None and marks.reads_ours,
            breakpoint_writes=marks is not None and marks.writes_ours,
        )
        if marks is not None:
            m.observe_breakpoints(marks.dialect, [mark.kind for mark in marks.placed], marks.refused)
        brk = plan.broke if plan is not None else None
        if plan is not None:
            if plan.match is not None:
                m.observe_match(plan.matched_messages, plan.messages)
            repair = plan.repair
            if plan.refused:
                m.observe_refused(plan.refused)
            if repair.repairs:
                m.observe_repairs((r.kind for r in repair.repairs), repair.rescued_tokens, model)
            if brk is not None:
                m.observe_break(brk.reason)
                if brk.span is not None and self.breaks is not None:
                    span = brk.span
                    self.breaks.note_break(plan.root, brk.reason, _where(span.depth), span.shape, span.hint, time.time())
        verdict = answer.verdict
        if verdict is not None:
            m.observe_provider_verdict(verdict.verdict, verdict.side, verdict.reason)
        if log.isEnabledFor(logging.INFO):
            _log_line(api, model, stream, plan, answer, duration)
        if log.isEnabledFor(logging.DEBUG) and plan is not None:
            log.debug("prefix %s", visibility_headers(plan).get(PREFIX_HEADER, "-"))


def _log_line(api: str, model: str, stream: bool, plan: TurnPlan | None, answer: Answer, duration: float) -> None:
    u = answer.usage
    prompt = u.prompt_tokens if u else None
    cached = u.cached_tokens if u else None
    hit = f"{100.0 * cached / prompt:.1f}%" if prompt and cached is not None else "?"
    cost = answer.cost
    price = f"${cost.usd:.6f}{'' if cost.billed else '~'}" if cost and cost.usd is not None else "?"
    brk = plan.broke if plan is not None else None
    verdict = answer.verdict
    log.info(
        "%s model=%s status=%s stream=%s prompt=%s cached=%s hit=%s repaired=%d break=%s%s cost=%s duration=%.3fs%s%s",
        api, model or "-", answer.status, stream, prompt, cached, hit,
        len(plan.repair.repairs) if plan is not None else 0,
        brk.reason if brk is not None else "-", f" provider={verdict.label}" if verdict is not None else "",
        price, duration,
        f" unrepaired={plan.refused}" if plan is not None and plan.refused else "",
        f" failed_open={','.join(answer.failed)}" if answer.failed else "",
    )


def visibility_headers(plan: TurnPlan, marks: Marks | None = None) -> dict[str, str]:
    """The ``x-kvwarm-prefix`` (and ``x-kvwarm-break``) headers of a planned request (``marks``:
    the cache markers kvwarm placed on it)."""
    if plan.match is None:
        return {}
    parts = [f"matched={plan.matched_messages}/{plan.messages}"]
    repairs = plan.repair.repairs
    parts.append(f"repaired={len(repairs)}")
    if repairs:
        parts.append(f"rescued={plan.repair.rescued_tokens}")
    headers: dict[str, str] = {}
    brk = plan.broke
    if brk is not None:
        parts.append(f"break={brk.reason}@{'tools' if brk.depth == 0 else brk.depth - 1}")
        span = brk.span
        if span is not None:
            headers[BREAK_HEADER] = _ascii(
                f"{brk.reason} at {_where(span.depth)} offset={span.offset} length={span.length} "
                f"shape={span.shape} hint={span.hint}"
            )
    if marks is not None:
        parts.append(f"breakpoints={len(marks.placed)}")
    headers[PREFIX_HEADER] = "; ".join(parts)
    return headers


def _where(depth: int) -> str:
    return "tools" if depth == 0 else f"messages[{depth - 1}]"


_CONTROL = {i: f"\\x{i:02x}" for i in (*range(32), 127)}


def _ascii(text: str) -> str:
    """A header-safe value: non-ASCII and control characters (CR, LF, TAB, ...) escaped."""
    return text.encode("ascii", "backslashreplace").decode("ascii").translate(_CONTROL)[:1000]
