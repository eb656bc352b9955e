"""Cache breakpoints: what the provider's cache reads, writes and bills, direct, through kvwarm,
and under a static marker policy.

``python -m tests.bench.breakpoints [--quick]`` (also the ``breakpoints`` section of
``python -m tests.bench.run``).

The upstream is the reference upstream in its breakpoint modes (proxy/sim/markers.py):
``openai-breakpoints`` (GPT-5.6: an implicit breakpoint at the latest user or tool message,
explicit ``prompt_cache_breakpoint`` markers, writes billed 1.25x) and ``anthropic`` (nothing
cached without ``cache_control`` markers, at most four, 20 blocks of lookback). Each workload
(tests/breakpoints/workloads.py, which the tests run too) goes three routes, each to a fresh
upstream so that no route reads another's cache:

- ``direct``: the client's requests as they are;
- ``static``: the client marks its system prompt and its latest message every turn, as other
  proxies and agents inject markers (for the client that marks its own, its markers are this);
- ``kvwarm``: the client's requests through kvwarm (``upstream.cache_breakpoints`` set for the
  upstream's dialect), which marks where its tree says a prefix is shared or will be read again.

Reported per workload and route, from the usage the upstream returned (and billed as it bills:
proxy/sim/accounting.py): the cached share of the prompt tokens, the tokens written to the cache
and the USD charged. Everything runs in this process on loopback sockets (the real apps); the
numbers are token counts and prices, not timings, so they do not depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import openai

from proxy.sim.markers import ANTHROPIC, OPENAI_BREAKPOINTS
from proxy.sim.server import SimConfig, create_sim_app
from tests.bench.report import Section, Table
from tests.bench.routing import kvwarm, serving
from tests.breakpoints.workloads import (
    Ledger,
    agent,
    ask,
    marked_last,
    single_shot_tasks,
    subagents,
)

ROUTES = ("direct", "static", "kvwarm")
SETTINGS = {OPENAI_BREAKPOINTS: "openai", ANTHROPIC: "cache_control"}
"""The ``upstream.cache_breakpoints`` kvwarm runs with in front of each mode."""


@dataclass(frozen=True)
class Scale:
    tasks: int = 32
    """Single-shot tasks."""
    sessions: int = 8
    """Agent sessions (each two tasks of a tool round and an answer)."""
    subagents: int = 16


QUICK = Scale(tasks=12, sessions=3, subagents=6)

Drive = Callable[[openai.AsyncOpenAI, Ledger, bool, Scale], Awaitable[None]]
"""Runs a workload as one client, marking statically or not."""


async def _single_shot(client: openai.AsyncOpenAI, ledger: Ledger, static: bool, scale: Scale) -> None:
    for messages in single_shot_tasks(scale.tasks):
        await ask(client, ledger, marked_last(messages, ledger.mode) if static else messages)


async def _sessions(client: openai.AsyncOpenAI, ledger: Ledger, static: bool, scale: Scale) -> None:
    for i in range(scale.sessions):
        await agent(client, ledger, f"agent-{i}", static=static)


async def _subagents(client: openai.AsyncOpenAI, ledger: Ledger, static: bool, scale: Scale) -> None:
    await subagents(client, ledger, scale.subagents, static=static)


@dataclass(frozen=True)
class Workload:
    name: str
    mode: str
    """The upstream's cache mode."""
    drive: Drive
    marks_itself: bool = False
    """The client marks every request itself (the static policy): it goes ``direct`` and
    through kvwarm with its own markers, and ``static`` is its ``direct``."""


WORKLOADS = (
    Workload("single-shot tasks, one long system prompt", OPENAI_BREAKPOINTS, _single_shot),
    Workload("single-shot tasks, one long system prompt", ANTHROPIC, _single_shot),
    Workload("multi-turn tool-using sessions", OPENAI_BREAKPOINTS, _sessions),
    Workload("parallel subagents from one shared brief", OPENAI_BREAKPOINTS, _subagents),
    Workload("parallel subagents from one shared brief", ANTHROPIC, _subagents),
    Workload("agent sending no markers", ANTHROPIC, _sessions),
    Workload("client moving its own markers every turn", ANTHROPIC, _sessions, marks_itself=True),
)


@dataclass
class Result:
    workload: Workload
    ledgers: dict[str, Ledger] = field(default_factory=dict)


@contextlib.asynccontextmanager
async def route(name: str, mode: str) -> AsyncIterator[openai.AsyncOpenAI]:
    """A client of a fresh upstream in ``mode``, directly or (``kvwarm``) through kvwarm."""
    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(serving(create_sim_app(SimConfig(cache_mode=mode))))
        if name == "kvwarm":
            url, _ = await stack.enter_async_context(
                kvwarm([url + "/v1"], **{"upstream.cache_breakpoints": SETTINGS[mode]})
            )
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-bench-breakpoints", max_retries=0)
        stack.push_async_callback(client.close)
        yield client


async def measure(workload: Workload, scale: Scale) -> Result:
    result = Result(workload)
    for name in ROUTES:
        if name == "static" and workload.marks_itself:
            continue
        ledger = Ledger(workload.mode)
        async with route(name, workload.mode) as client:
            await workload.drive(client, ledger, name == "static" or workload.marks_itself, scale)
        result.ledgers[name] = ledger
    return result


async def measure_all(scale: Scale) -> list[Result]:
    return [await measure(w, scale) for w in WORKLOADS]


def _usd(value: float) -> str:
    return f"${value * 1000:.3f}m"


def section(results: list[Result], scale: Scale, seconds: float) -> Section:
    table = Table(
        "Cached share, cache writes and cost per workload (the upstream's usage and bill)",
        ["workload", "upstream", "route", "requests", "prompt tokens", "cached share", "written tokens", "USD", "vs direct"],
    )
    findings = []
    for r in results:
        w, direct = r.workload, r.ledgers["direct"]
        for name, ledger in r.ledgers.items():
            label = "static (the client's own)" if name == "direct" and w.marks_itself else name
            table.add(
                w.name, f"`{w.mode}`", label, len(ledger.prompts), f"{sum(ledger.prompts):,}", f"{ledger.share:.1%}",
                f"{sum(ledger.written):,}", _usd(ledger.usd), f"{ledger.usd / direct.usd:.2f}x",
            )
        ours = r.ledgers["kvwarm"]
        static = r.ledgers.get("static", direct)
        findings.append(
            f"{w.name} (`{w.mode}`): kvwarm {ours.share:.0%} cached at {ours.usd / direct.usd:.2f}x the direct cost"
            + ("" if w.marks_itself else f", the static policy {static.share:.0%} at {static.usd / direct.usd:.2f}x")
            + ("" if _same_prompts(r) else " (prompt tokens differ between routes!)")
            + "."
        )
    table.notes = [
        f"Scale: {scale.tasks} single-shot tasks; {scale.sessions} agent sessions of two tasks (a tool round and "
        f"an answer each, the second task's tool results in 12 parts); {scale.subagents} subagents in two batches run "
        "at once, each a tool round and an answer after the shared brief. Each route starts from an empty cache (a fresh upstream).",
        "USD: as the upstream bills (proxy/sim/accounting.py): uncached input 1x, a cache read 0.1x, a write 1.25x "
        "the input price, output at its price; `m` = thousandths of a dollar. Markers render no token: every route "
        "sends the same prompt tokens.",
        "`static`: a marker on the system prompt and on the latest message every turn (`prompt_cache_breakpoint` "
        "on `openai-breakpoints`, `cache_control` on `anthropic`). For the client moving its own markers, that is "
        "the client itself, direct and through kvwarm.",
    ]
    return Section("Cache breakpoints: direct, a static policy, and kvwarm", [table], findings, seconds)


def _same_prompts(result: Result) -> bool:
    return len({tuple(sorted(ledger.prompts)) for ledger in result.ledgers.values()}) == 1  # in the order answered


def run(quick: bool = False) -> Section:
    """The ``breakpoints`` section of ``python -m tests.bench.run``."""
    scale = QUICK if quick else Scale()
    started = time.perf_counter()
    results = asyncio.run(measure_all(scale))
    return section(results, scale, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.breakpoints", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tasks, sessions and subagents")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    print(run(args.quick).markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
