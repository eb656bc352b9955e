"""The keep-alive: each paused session's last turn, watched, and its pings sent when they pay.

On the request path, :meth:`KeepAlive.note` (the pipeline calls it once a turn is recorded) does
O(1) bookkeeping and nothing else:

- a turn that continues a watched session ends that watch: its matched prefix holds the
  session's previous request followed by the reply kvwarm recorded, and the request element
  just before that reply (``Tree.previous_end``, which planning found already) is the key the
  session was watched under. The pause is learned (:mod:`proxy.keepalive.gaps`) and what the
  session's pings came to is counted: the write they avoided when the turn came back after the
  prefix would have expired and read it, else their cost, lost;
- a turn answered 2xx on an upstream kvwarm marks (:mod:`proxy.core.breakpoints`) whose usage
  says what it read and wrote starts watching its session: a reference to the bytes forwarded,
  the replica that served it, its API's headers and the session's credential (in memory only).

The watches are kept by key and by due time (:mod:`proxy.keepalive.schedule`). In the
background, :meth:`KeepAlive.run` (a task the app owns) wakes when the first watch falls due,
``keepalive.lead_seconds`` before its prefix expires, and :meth:`KeepAlive.run_due` decides
each due ping (:func:`proxy.keepalive.bet.decide`): quiet past ``max_session_seconds``, unpriced,
not worth its cost, or not within the budget (:mod:`proxy.keepalive.budget`), and the session's
pings end (its credential and bytes are dropped; the watch stays, without them, until its
horizon, to learn whether the session comes back). Else the ping (:mod:`proxy.keepalive.ping`)
goes to the replica that served the session, once (:mod:`proxy.keepalive.exchange`): a failure
costs that ping and nothing more (no retry, no error to anyone; counted). Nothing of a ping is recorded as a turn, remembered for
routing or counted as a client's request; its tokens and cost have their own metrics.

Time is the injected clock's (the app's default: the event loop's); tests and the bench move it
and call :meth:`KeepAlive.run_due` themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from .. import __version__
from ..config import KeepaliveSettings
from ..core.breakpoints import CACHE_CONTROL, OPENAI
from ..core.pricing import PriceTable, cost_of
from ..core.usage import Usage
from ..metrics import ProxyMetrics
from ..transport.http1 import speaks_anthropic
from .bet import Stake, decide, saved
from .budget import Budget
from .exchange import exchange, ping_of, usage_of
from .gaps import TenantGaps
from .ping import OUTPUT_LIMITS, api_of
from .schedule import Schedule
from .watch import Watch

if TYPE_CHECKING:
    from ..request.turn import Turn
    from ..routing import Replica

__all__ = ["DEFAULT_TTLS", "KeepAlive", "ping_headers"]

log = logging.getLogger(__name__)

DEFAULT_TTLS = {CACHE_CONTROL: 300.0, OPENAI: 1800.0}
"""A dialect's cache TTL when the usage does not say (Anthropic-style 5 minutes; OpenAI 30)."""
_TTL_SECONDS = {"5m": 300.0, "1h": 3600.0, "30m": 1800.0, "12h": 43200.0}
CONCURRENT_PINGS = 16
MAX_NAP = 60.0
"""Loop seconds the background task sleeps at most before it looks at the clock again."""
MODELS = 64
"""Models whose pings' output is remembered (the least recently pinged forgotten first)."""
_API_HEADERS = ("anthropic-version", "anthropic-beta", "OpenAI-Organization", "OpenAI-Project", "OpenAI-Beta")
_CREDENTIALS = ("Authorization", "x-api-key", "api-key", "x-goog-api-key")
USER_AGENT = f"kvwarm-keepalive/{__version__}"


def ping_headers(incoming: Mapping[str, str], api_key: str = "") -> tuple[tuple[str, str], ...]:
    """What a ping carries: the headers its API needs and the credential the session's request went
    upstream with (``upstream.api_key`` where it replaces the client's, as for every request)."""
    out = [("Content-Type", "application/json"), ("User-Agent", USER_AGENT)]
    out += [(name, value) for name in _API_HEADERS if (value := incoming.get(name)) is not None]
    if api_key:
        out.append(("x-api-key", api_key) if speaks_anthropic(incoming) else ("Authorization", f"Bearer {api_key}"))
    else:
        out += [(name, value) for name in _CREDENTIALS if (value := incoming.get(name)) is not None]
    return tuple(out)


class KeepAlive:
    """The watched sessions, their due pings, the tenants' pauses and the budget (module docstring)."""

    def __init__(
        self,
        settings: KeepaliveSettings,
        *,
        prices: PriceTable,
        metrics: ProxyMetrics,
        clock: Callable[[], float],
        health_clock: Callable[[], float] = time.monotonic,
        api_key: str = "",
        workers: int = 1,
    ) -> None:
        self.settings = settings
        self.prices = prices
        self.metrics = metrics
        self.clock = clock
        """Seconds, for the TTLs, pauses and budget (the app's: the event loop's time)."""
        self.health_clock = health_clock
        """The router's clock, which the replicas' health is kept in."""
        self.api_key = api_key
        self.budget = Budget(settings.budget_usd_per_day / max(1, workers))
        self.gaps = TenantGaps()
        self.outputs: OrderedDict[str, int] = OrderedDict()
        """Output tokens the last ping for each model generated: a provider may give more than the
        least a ping asks for (a reasoning model's, one that ignores the limit), and a session's
        first ping is priced on what the model's pings made before."""
        self.schedule = Schedule()
        """The watched sessions, by key and by due time (:mod:`proxy.keepalive.schedule`)."""
        self._lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(CONCURRENT_PINGS)

    @property
    def watches(self) -> OrderedDict[bytes, Watch]:
        """Watched sessions by the key of their last request's last element, oldest turn first."""
        return self.schedule.watches

    # -- the request path -------------------------------------------------------------------------

    def note(self, turn: Turn, replica: Replica, sent: bytes) -> None:
        """A turn was recorded (``sent``: the bytes that went to ``replica``). O(1)."""
        plan = turn.plan
        if plan is None or plan.match is None:
            return
        now = self.clock()
        arrived = now - max(0.0, time.perf_counter() - turn.started)
        keys = plan.match.keys
        tree = plan.tree
        usage = turn.answer.usage
        schedule = self.schedule
        if tree is not None and 0 <= tree.previous_end < len(keys):
            back = schedule.pop(keys[tree.previous_end])
            if back is not None:
                self._came_back(back, arrived, usage)
        watch = self._watch_of(turn, replica, sent, arrived)
        if watch is None:
            return
        again = schedule.pop(watch.key)  # the same request sent again: the session is back
        if again is not None:
            self._came_back(again, arrived, usage)
        if len(schedule) >= self.settings.max_sessions:
            oldest = schedule.pop_oldest()
            self._settle(oldest, None, None)
            oldest.close()
        schedule.add(watch)

    def _watch_of(self, turn: Turn, replica: Replica, sent: bytes, arrived: float) -> Watch | None:
        """The watch of a turn whose cached prefix may be kept warm, else None."""
        marks, usage, plan = turn.answer.marks, turn.answer.usage, turn.plan
        if not turn.answered or marks is None or marks.error is not None or usage is None or plan is None:
            return None
        api = api_of(turn.request.path)
        prompt, cached, written = usage.prompt_tokens, usage.cached_tokens, usage.cache_write_tokens
        if api is None or prompt is None or cached is None or written is None or plan.match is None:
            return None
        prefix = min(prompt, cached + written)
        if prefix <= 0 or marks.dialect not in DEFAULT_TTLS:
            return None  # nothing cached, nothing to keep
        ttl = self._ttl(marks.dialect, usage)
        request = turn.request
        return Watch(
            key=plan.match.keys[-1], root=turn.root, model=turn.model, dialect=marks.dialect, api=api,
            path=request.path, query=request.rel_url.raw_query_string, replica=replica, raw=sent,
            headers=ping_headers(request.headers, self.api_key), turn_at=arrived, ttl=ttl,
            prefix=prefix, tail=max(0, prompt - prefix), output=max(OUTPUT_LIMITS[api], self.outputs.get(turn.model, 0)),
            due=arrived + ttl - self.settings.lead_seconds,
            horizon=arrived + self.settings.max_session_seconds + ttl,
        )

    def _ttl(self, dialect: str, usage: Usage) -> float:
        """The prefix's TTL: the setting, else the shortest TTL the turn wrote for, else the dialect's."""
        if self.settings.ttl_seconds > 0:
            return self.settings.ttl_seconds
        written = [_TTL_SECONDS[bucket] for bucket, count in usage.writes_by_ttl() if count > 0 and bucket in _TTL_SECONDS]
        return min(written) if written else DEFAULT_TTLS[dialect]

    def _came_back(self, watch: Watch, arrived: float, usage: Usage | None) -> None:
        """The watched session sent its next turn at ``arrived``: the pause is learned (and, when the
        prefix had expired, what it read all the same), the pings settled."""
        gaps = self.gaps.of(watch.root)
        gaps.add(arrived - watch.turn_at)
        if arrived > watch.used_at + watch.ttl and usage is not None and usage.cached_tokens is not None:
            gaps.add_late_read(min(usage.cached_tokens, watch.prefix))
        self._settle(watch, arrived, usage)
        watch.close()

    def _settle(self, watch: Watch, back_at: float | None, usage: Usage | None) -> None:
        """What the session's pings came to: the write avoided, when it came back after the prefix
        would have expired, while the pings kept it, and read it; else their cost, lost."""
        if not watch.pings:
            return
        usd = saved(watch, back_at, usage, self.prices, self.gaps)
        if usd > 0:
            self.metrics.observe_keepalive_result(saved_usd=usd)
        else:
            self.metrics.observe_keepalive_result(lost_usd=watch.spent)

    # -- the background ---------------------------------------------------------------------------

    def next_due(self) -> float | None:
        """When the first watch falls due (clock time); None: nothing is watched."""
        return self.schedule.next_due()

    async def run(self) -> None:
        """Until cancelled: sleep until the first watch falls due (or a new one comes first), run it."""
        wake = self.schedule.wake
        while True:
            wake.clear()
            due = self.schedule.next_due()
            delay = MAX_NAP if due is None else due - self.clock()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(delay, MAX_NAP)):
                        await wake.wait()
                continue
            await self.run_due()

    async def run_due(self) -> None:
        """Every watch due by now: its ping decided and sent, or its horizon reached."""
        async with self._lock:
            now = self.clock()
            due = self.schedule.take_due(now)
            if due:
                await asyncio.gather(*(self._fall_due(watch, now) for watch in due))

    async def _fall_due(self, watch: Watch, now: float) -> None:
        if not watch.active or now >= watch.horizon:  # its horizon: it never came back
            if not self.schedule.watched(watch):
                return
            self.schedule.pop(watch.key)
            self.gaps.of(watch.root).add_never()
            self._settle(watch, None, None)
            watch.close()
            return
        try:
            async with self._slots:
                await self._ping(watch, now)
        except Exception:  # the fail-open boundary of the background: counted, never raised
            log.exception("keep-alive ping failed")
            self.metrics.error("keepalive")
            self._stop(watch, "failed")

    async def close(self) -> None:
        """Drop every credential and body (at shutdown, once the task is done)."""
        for watch in self.schedule.clear():
            watch.close()

    # -- one ping ---------------------------------------------------------------------------------

    async def _ping(self, watch: Watch, now: float) -> None:
        decided = self._decide(watch, now)
        if isinstance(decided, Stake):
            body = await ping_of(watch)
            if body is None:
                decided = "unsupported"
            elif watch.output > OUTPUT_LIMITS[watch.api]:
                decided = self._decide(watch, now)  # a larger output than assumed (extended thinking)
        if isinstance(decided, str):
            self._stop(watch, decided)
            return
        if watch.replica is None or watch.body is None:
            return  # the session came back while its ping was being made
        if not watch.replica.health.available(self.health_clock()):
            self._stop(watch, "failed")
        elif not self.budget.reserve(now, decided.worst):
            self._stop(watch, "budget_exhausted")
        else:
            await self._send(watch, watch.body, decided, now)

    def _decide(self, watch: Watch, now: float) -> Stake | str:
        """The stake of the session's next ping when a run of pings from now pays; else why not."""
        settings = self.settings
        return decide(watch, now, self.prices, self.gaps, lead=settings.lead_seconds, max_age=settings.max_session_seconds)

    async def _send(self, watch: Watch, body: bytes, bet: Stake, now: float) -> None:
        """Send the ping once and count what it read and cost (a failure: that ping, nothing more)."""
        status: int | None = None
        usage: Usage | None = None
        try:
            status, answer = await exchange(watch, body)
            if 200 <= status < 300:
                usage = usage_of(answer)
        except Exception as exc:  # unreachable, timed out, cut: the ping failed, nobody else did
            log.info("keep-alive ping of a %s session to %s failed: %s", watch.model, watch.replica_label, exc)
        price = self.prices.lookup(watch.model)
        if usage is None or price is None:
            # An error status is not billed; a ping that broke after it was sent may have been.
            self.budget.settle(now, bet.worst, 0.0 if status is not None and status >= 400 else bet.worst)
            if status is not None:
                log.info("keep-alive ping of a %s session to %s answered %d", watch.model, watch.replica_label, status)
            self._stop(watch, "failed")
            return
        cost = cost_of(usage, price)
        usd = max(0.0, cost.usd or 0.0)
        self.budget.settle(now, bet.worst, usd)
        watch.read(usage, at=now, usd=usd)
        self._learn_output(watch.model, watch.output)
        self.metrics.observe_keepalive("missed" if watch.missed else "sent", model=watch.model, usage=usage, cost=cost)
        if not self.schedule.watched(watch):  # the session came back while the ping was out
            self.metrics.observe_keepalive_result(lost_usd=usd)
        elif watch.missed:
            self._stop(watch, "")
        else:
            watch.due = now + watch.ttl - self.settings.lead_seconds
            self.schedule.push(watch)

    def _learn_output(self, model: str, tokens: int) -> None:
        outputs = self.outputs
        outputs[model] = tokens
        outputs.move_to_end(model)
        if len(outputs) > MODELS:
            outputs.popitem(last=False)

    def _stop(self, watch: Watch, outcome: str) -> None:
        """The session's pings end (``outcome`` counted, when one): credential and bytes dropped; it
        stays watched, without them, until its horizon."""
        if outcome:
            self.metrics.observe_keepalive(outcome, model=watch.model)
        watch.close()
        if self.schedule.watched(watch):
            watch.due = max(watch.horizon, self.clock())
            self.schedule.push(watch)
