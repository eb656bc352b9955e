"""Keep-alive on paused sessions: total cost with kvwarm's keep-alive, without it, and with a
fixed-interval pinger.

``python -m tests.bench.keepalive [--sessions 48] [--one-shots 12] [--seed 7]`` (also the
``keepalive`` section of ``python -m tests.bench.run``).

One tenant's coding-agent sessions, started over four hours, each a run of 3 to 8 turns with
pauses drawn from a mix: most short (a tool runs: 5-90 s), some within the TTL (a quick read),
about a quarter just past it (a person reads the diff, CI runs: 1.05-1.5 TTL), a few long
(2.2-3.5 TTL); after its last turn a session is abandoned. A second tenant sends one-shot tasks
that never come back. Every turn carries a shared system prompt and the session's growing
history (tool results of ~2,000 tokens: a file, a diff, a test log).

Each variant runs the very same sessions on a fresh reference upstream and a fresh kvwarm (which
places the cache markers in every variant), in the upstream's ``anthropic`` mode (5-minute
TTL, refreshed by each read) and its ``openai-breakpoints`` mode (30 minutes):

``none``      no keep-alive;
``kvwarm``    kvwarm's keep-alive (``[keepalive]``, budget ample);
``fixed``     a client-side pinger as Aider's ``--cache-keepalive-pings``: after each turn, the
              session's last request with ``max_tokens: 1`` every TTL less 30 s (4m30s; 29m30s),
              up to as many pings as fit in kvwarm's longest keep-alive (an hour), through kvwarm;
``oracle``    the same pings as ``fixed``, but only those that pay off: it knows each pause in
              advance, and pings a session only when it will come back after its TTL, as many
              times as that takes (the saving no pinger can beat, for reference);
``kvwarm, tight budget``  the keep-alive with a budget smaller than what it spends above.

Time is simulated: the upstream's clock and kvwarm's injected clock are one ``SimClock``, moved
event by event (a turn, a fixed ping, or the keep-alive's next due ping). Cost is what the upstream
bills (``proxy/sim/accounting.py``: a read 0.1 x input, a write 1.25 x): the turns' and the fixed
pings' from the usage they returned, kvwarm's pings from ``kvwarm_cost_usd_total{source="keepalive"}``
(its price table is the upstream's billing). The reference upstream ignores ``max_tokens``: every
ping, kvwarm's and the fixed pinger's alike, is billed its full short reply.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.appkeys import REGISTRY
from proxy.config import load_settings
from proxy.keepalive import KEEPALIVE
from proxy.keepalive.keeper import USER_AGENT
from proxy.sim.accounting import READ_PRICE, WRITE_PRICE, Accounting
from proxy.sim.clock import SimClock
from proxy.sim.markers import ANTHROPIC, OPENAI_BREAKPOINTS
from proxy.sim.server import SIM_STATE, SimConfig, create_sim_app
from tests.bench.report import Section, Table
from tests.sim.conftest import SEARCH_TOOL, WEATHER_TOOL, long_system_prompt

MODEL = "sim-cache"
MODES = {ANTHROPIC: ("cache_control", 300.0), OPENAI_BREAKPOINTS: ("openai", 1800.0)}
"""Upstream mode -> (kvwarm's marker dialect, the TTL of its prefixes)."""
VARIANTS = ("none", "kvwarm", "fixed", "oracle", "kvwarm, tight budget")
AGENTS, ONE_SHOT = "sk-agents", "sk-one-shot"
LEAD = 30.0
MAX_SESSION = 3600.0
BUDGET = 50.0
"""USD a day: never reached by this workload (the tight variant gets a fraction of what it spends)."""
TIGHT = 0.4
"""The tight budget, as a share of what the keep-alive spent with an ample one."""


@dataclass(frozen=True)
class Workload:
    sessions: int = 48
    one_shots: int = 12
    seed: int = 7
    spread_hours: float = 4.0
    system_sentences: int = 400
    """About 5,600 tokens of shared system prompt."""
    tool_output_lines: int = 150
    """About 2,000 tokens of tool output per turn (a file read, a diff, a test log)."""


@dataclass(frozen=True)
class SessionPlan:
    """One session: its tenant, when it starts, and the pauses after each of its turns but the last."""

    key: str
    name: str
    start: float
    pauses: tuple[float, ...]


def pause(rng: random.Random, ttl: float) -> float:
    """A pause between two turns of an agent session (module docstring)."""
    draw = rng.random()
    if draw < 0.55:
        return rng.uniform(5.0, 90.0)
    if draw < 0.68:
        return rng.uniform(0.3, 0.9) * ttl
    if draw < 0.93:
        return rng.uniform(1.05, 1.5) * ttl
    return rng.uniform(2.2, 3.5) * ttl


def plan_sessions(workload: Workload, ttl: float) -> list[SessionPlan]:
    rng = random.Random(workload.seed)
    spread = workload.spread_hours * 3600.0
    plans = [
        SessionPlan(AGENTS, f"agent {i}", rng.uniform(0.0, spread), tuple(pause(rng, ttl) for _ in range(rng.randint(2, 7))))
        for i in range(workload.sessions)
    ]
    plans += [SessionPlan(ONE_SHOT, f"task {i}", rng.uniform(0.0, spread), ()) for i in range(workload.one_shots)]
    return plans


@dataclass
class Result:
    mode: str
    variant: str
    turns: int = 0
    turn_usd: float = 0.0
    pings: int = 0
    ping_usd: float = 0.0
    pings_by_tenant: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, float] = field(default_factory=dict)
    saved_usd: float = 0.0
    lost_usd: float = 0.0
    budget: float = BUDGET
    cached_returns: int = 0
    """Turns after a pause past the TTL that read their session's previous prefix."""
    late_returns: int = 0
    """Turns after a pause past the TTL."""

    @property
    def total(self) -> float:
        return self.turn_usd + self.ping_usd


def bill(usage: dict[str, Any], mode: str) -> float:
    """What the upstream billed for a response, from the usage it returned."""
    details = usage.get("prompt_tokens_details") or {}
    return Accounting(
        prompt_tokens=usage["prompt_tokens"], cached_tokens=details.get("cached_tokens") or 0,
        completion_tokens=usage["completion_tokens"], reasoning_tokens=0,
        cache_write_tokens=details.get("cache_write_tokens") or 0, cache_mode=mode,
    ).charged(SimConfig(cache_mode=mode))


class Agent:
    """One session's history and its requests through kvwarm."""

    def __init__(self, plan: SessionPlan, system: str, output_lines: int) -> None:
        self.plan = plan
        self.messages: list[Any] = [{"role": "system", "content": system}, {"role": "user", "content": f"{plan.name}: fix the failing test."}]
        self.output = " ".join(f"{plan.name} line {k}: ok." for k in range(output_lines))
        self.turns = 0
        self.last: bytes = b""
        """The body of the session's latest request (what a fixed pinger re-sends)."""
        self.last_at = 0.0
        self.prefix = 0

    def body(self) -> bytes:
        tools = [WEATHER_TOOL, SEARCH_TOOL] if self.plan.key == AGENTS else []
        return orjson.dumps({"model": MODEL, "messages": self.messages, **({"tools": tools} if tools else {})})

    def answered(self, reply: dict[str, Any]) -> None:
        message = reply["choices"][0]["message"]
        self.messages.append({k: v for k, v in message.items() if v is not None and k not in ("refusal", "annotations")})
        calls = message.get("tool_calls") or []
        for call in calls:
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": self.output})
        if not calls:
            self.messages.append({"role": "user", "content": f"{self.plan.name}: next step {self.turns}."})


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


class Run:
    """One variant in one mode: the event loop over simulated time."""

    def __init__(self, mode: str, variant: str, plans: list[SessionPlan], workload: Workload, prices: Path, budget: float) -> None:
        self.mode, self.variant, self.plans, self.workload = mode, variant, plans, workload
        self.dialect, self.ttl = MODES[mode]
        self.clock = SimClock(lambda: 0.0)
        self.result = Result(mode, variant, budget=budget)
        self.events: list[tuple[float, int, str, int, float]] = []
        """(time, tie-breaker, "turn" | "ping", session, the turn time the ping follows)."""
        self._seq = itertools.count()
        self.settings = load_settings(None, env={}, overrides={
            "store.backend": "memory", "log.level": "WARNING", "upstream.cache_breakpoints": self.dialect,
            "metrics.prices_file": str(prices), "keepalive.enabled": variant.startswith("kvwarm"),
            "keepalive.budget_usd_per_day": budget, "keepalive.max_session_seconds": MAX_SESSION,
            "keepalive.lead_seconds": LEAD,
        })

    def push(self, at: float, kind: str, index: int, origin: float = 0.0) -> None:
        heapq.heappush(self.events, (at, next(self._seq), kind, index, origin))

    async def run(self) -> Result:
        sim = create_sim_app(SimConfig(cache_mode=self.mode, clock=self.clock))
        async with serving(sim) as sim_url:
            self.settings = self.settings.with_overrides({"upstream.base_url": sim_url + "/v1"})
            app = create_app(self.settings, registry=CollectorRegistry(), clock=self.clock)
            async with serving(app) as url, aiohttp.ClientSession() as http:
                agents = [Agent(p, long_system_prompt(self.workload.system_sentences), self.workload.tool_output_lines) for p in self.plans]
                for i, plan in enumerate(self.plans):
                    self.push(plan.start, "turn", i)
                await self.loop(app, http, url, agents)
                self.read_metrics(app, sim)
        return self.result

    async def loop(self, app: web.Application, http: aiohttp.ClientSession, url: str, agents: list[Agent]) -> None:
        keeper = app.get(KEEPALIVE)
        while True:
            due = keeper.next_due() if keeper is not None else None
            if self.events and (due is None or self.events[0][0] < due):
                at, _, kind, index, origin = heapq.heappop(self.events)
                self.clock.advance(max(0.0, at - self.clock()))
                if kind == "turn":
                    await self.turn(http, url, agents[index], index)
                elif agents[index].last_at == origin:  # a fixed ping: only while the session pauses
                    await self.fixed_ping(http, url, agents[index])
            elif due is not None and keeper is not None:
                self.clock.advance(max(0.0, due - self.clock()))
                await keeper.run_due()
            else:
                return

    async def post(self, http: aiohttp.ClientSession, url: str, key: str, body: bytes) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        async with http.post(f"{url}/v1/chat/completions", data=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            data: dict[str, Any] = await r.json()
            return data

    async def turn(self, http: aiohttp.ClientSession, url: str, agent: Agent, index: int) -> None:
        now = self.clock()
        body = agent.body()
        reply = await self.post(http, url, agent.plan.key, body)
        usage = reply["usage"]
        details = usage.get("prompt_tokens_details") or {}
        if agent.turns and now - agent.last_at > self.ttl:
            self.result.late_returns += 1
            self.result.cached_returns += int((details.get("cached_tokens") or 0) >= agent.prefix > 0)
        agent.prefix = (details.get("cached_tokens") or 0) + (details.get("cache_write_tokens") or 0)
        self.result.turns += 1
        self.result.turn_usd += bill(usage, self.mode)
        agent.turns += 1
        agent.last, agent.last_at = body, now
        agent.answered(reply)
        pauses = agent.plan.pauses
        if agent.turns <= len(pauses):
            self.push(now + pauses[agent.turns - 1], "turn", index)
        interval = self.ttl - LEAD
        if self.variant == "fixed":
            for j in range(1, int(MAX_SESSION // interval) + 1):
                self.push(now + j * interval, "ping", index, now)
        elif self.variant == "oracle" and agent.turns <= len(pauses):
            for j in range(1, int(pauses[agent.turns - 1] // interval) + 1):
                self.push(now + j * interval, "ping", index, now)

    async def fixed_ping(self, http: aiohttp.ClientSession, url: str, agent: Agent) -> None:
        body = orjson.loads(agent.last)
        body["max_tokens"] = 1
        reply = await self.post(http, url, agent.plan.key, orjson.dumps(body))
        self.result.pings += 1
        self.result.ping_usd += bill(reply["usage"], self.mode)
        self.result.pings_by_tenant[agent.plan.key] = self.result.pings_by_tenant.get(agent.plan.key, 0) + 1

    def read_metrics(self, app: web.Application, sim: web.Application) -> None:
        if not self.variant.startswith("kvwarm"):
            return
        registry = app[REGISTRY]

        def value(name: str, **labels: str) -> float:
            return registry.get_sample_value(name, labels) or 0.0

        result = self.result
        result.ping_usd = value("kvwarm_cost_usd_total", model=MODEL, source="keepalive")
        result.saved_usd = value("kvwarm_keepalive_saved_usd_total")
        result.lost_usd = value("kvwarm_keepalive_lost_usd_total")
        for family in registry.collect():
            if family.name == "kvwarm_keepalive_requests":
                result.outcomes = {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total") and s.value}
        pings = [r for r in sim[SIM_STATE].requests if r.headers.get("user-agent", "").startswith(USER_AGENT)]
        result.pings = len(pings)
        for r in pings:
            key = r.headers.get("authorization", "").removeprefix("Bearer ")
            result.pings_by_tenant[key] = result.pings_by_tenant.get(key, 0) + 1


async def compare(workload: Workload) -> dict[str, dict[str, Result]]:
    results: dict[str, dict[str, Result]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prices = Path(tmp) / "prices.toml"
        input_price = SimConfig().price_input
        prices.write_text(
            f'[models."{MODEL}"]\ninput = {input_price}\ncached_input = {READ_PRICE * input_price}\n'
            f"output = {SimConfig().price_output}\ncache_write_multiplier = {WRITE_PRICE}\n",
            encoding="utf-8",
        )
        for mode, (_, ttl) in MODES.items():
            plans = plan_sessions(workload, ttl)
            by_variant: dict[str, Result] = {}
            for variant in VARIANTS:
                budget = BUDGET
                if variant == "kvwarm, tight budget":
                    budget = max(1e-6, TIGHT * by_variant["kvwarm"].ping_usd)
                by_variant[variant] = await Run(mode, variant, plans, workload, prices, budget).run()
            results[mode] = by_variant
    return results


def usd(value: float) -> str:
    return f"${value:.4f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "n/a"


def table(mode: str, results: dict[str, Result]) -> Table:
    ttl = MODES[mode][1]
    none, fixed, oracle = results["none"], results["fixed"], results["oracle"]
    out = Table(
        f"{mode} ({ttl / 60:.0f}-minute TTL)",
        ["variant", "turns", "pings", "turns USD", "pings USD", "total USD", "vs none", "vs fixed",
         "saving vs oracle's", "late returns read", "one-shot pings"],
    )
    for variant in VARIANTS:
        r = results[variant]
        out.add(
            variant, r.turns, r.pings, usd(r.turn_usd), usd(r.ping_usd), usd(r.total), ratio(r.total, none.total),
            ratio(r.total, fixed.total), ratio(none.total - r.total, none.total - oracle.total),
            f"{r.cached_returns}/{r.late_returns}", r.pings_by_tenant.get(ONE_SHOT, 0),
        )
    kv, tight = results["kvwarm"], results["kvwarm, tight budget"]
    out.notes.append(
        f"kvwarm: pings by outcome {dict(sorted(kv.outcomes.items()))}; writes avoided {usd(kv.saved_usd)}, "
        f"lost on sessions not back in time {usd(kv.lost_usd)}."
    )
    out.notes.append(
        f"tight budget: {usd(tight.budget)} a day (a {TIGHT:.0%} of the ample run's spend); pings cost "
        f"{usd(tight.ping_usd)}; outcomes {dict(sorted(tight.outcomes.items()))}."
    )
    return out


def findings(results: dict[str, dict[str, Result]]) -> list[str]:
    out = []
    for mode, by in results.items():
        kv, none, fixed, tight = by["kvwarm"], by["none"], by["fixed"], by["kvwarm, tight budget"]
        oracle = by["oracle"]
        ok = kv.total < none.total and kv.total < fixed.total
        out.append(
            f"{mode}: keep-alive costs {ratio(kv.total, none.total)} of no keep-alive and {ratio(kv.total, fixed.total)} "
            f"of the fixed pinger ({'lower than both' if ok else 'NOT lower than both'}), "
            f"{ratio(none.total - kv.total, none.total - oracle.total)} of the oracle's saving; one-shot tenant pinged "
            f"{kv.pings_by_tenant.get(ONE_SHOT, 0)} times by kvwarm, {fixed.pings_by_tenant.get(ONE_SHOT, 0)} by the fixed pinger; "
            f"tight budget {'kept' if tight.ping_usd <= tight.budget + 1e-12 else 'EXCEEDED'} "
            f"({usd(tight.ping_usd)} of {usd(tight.budget)})."
        )
    return out


def section(workload: Workload, results: dict[str, dict[str, Result]], seconds: float) -> Section:
    tables = [table(mode, by) for mode, by in results.items()]
    tables[0].notes.insert(0, (
        f"{workload.sessions} agent sessions of 3-8 turns and {workload.one_shots} one-shot tasks over "
        f"{workload.spread_hours:g} h of simulated time, seed {workload.seed}; a session back after more than the TTL "
        "is a late return, read when it read its previous prefix."
    ))
    return Section("Keep-alive on paused sessions", tables, findings(results), seconds)


def run(quick: bool = False) -> Section:
    """The ``keepalive`` section of ``python -m tests.bench.run``."""
    workload = Workload(sessions=16, one_shots=4) if quick else Workload()
    started = time.perf_counter()
    results = asyncio.run(compare(workload))
    return section(workload, results, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.keepalive", description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=Workload.sessions)
    parser.add_argument("--one-shots", type=int, default=Workload.one_shots)
    parser.add_argument("--seed", type=int, default=Workload.seed)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    workload = Workload(sessions=args.sessions, one_shots=args.one_shots, seed=args.seed)
    started = time.perf_counter()
    print(section(workload, asyncio.run(compare(workload)), time.perf_counter() - started).markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
