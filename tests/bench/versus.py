"""Before and after: two versions of kvwarm, end to end through the HTTP proxy, in the same run.

``python -m tests.bench.versus --base COMMIT [--head COMMIT] [--quick] [--control] [--trees DIR]``
(``make bench-versus BASE=COMMIT``, with ``--control``; issue 30 compares its restructuring with
``5e389bf``).

Each version is extracted from git with ``git archive`` (never the working tree, whose edits in
progress would make the figures move), compiled in its own tree (``python -m proxy.build``, as
``make compile`` does there) and served as its own process (``python -m proxy serve --store
memory``, ``KVWARM_LOG_LEVEL=WARNING``, run in and importing from that tree) in front of the echo
upstream of :mod:`tests.bench.proxy_latency`. The versions' module paths differ, so nothing of
theirs is imported here: they are driven over HTTP, by this checkout's client. ``--trees DIR``
keeps the extracted, compiled trees in DIR (one per commit) for the next run; by default they
go to a temporary directory. ``--control`` adds a second process of the base tree to the throughput
cases: how far base lands from itself is the noise a ratio has to clear on this machine.

Measured, the two versions in rotating order within each round (base, head / head, base / ...),
medians over the rounds:

- each proxy's CPU time per request (user + system of its process, from ``/proc``: not the
  client's clock, so it does not depend on when a process was scheduled on the shared machine)
  and its throughput, :data:`~tests.bench.proxy_latency.CONCURRENCY` concurrent clients, for the
  cases of :mod:`tests.bench.proxy_latency`: the ~2 KiB and ~202 KiB conversations re-sent with
  their last turn changed, the 200-token stream, agent loops, and the captured Codex request;
- restoring values: :data:`TURNS`-turn agent sessions (many at a time, in lock step) whose every
  request re-sends all earlier assistant tool calls with the keys of their ``arguments``
  reordered (:func:`tests.agents.args_keys_reordered`), so kvwarm restores each to the form it
  first saw; against the same sessions with nothing reordered. CPU per request over the turns
  around 30, 60 and 120, and the cost of one restored value: (drifted - clean) / values
  restored (the ``repaired=`` count of the ``x-kvwarm-prefix`` header, checked against the
  number of earlier tool calls).

The aim (issue 30): head's CPU per request and throughput within 10 % of base's, and a restored
value no dearer than before.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import json
import re
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tests.agents import SYSTEM, TOOLS, args_keys_reordered
from tests.bench.conversations import SHORT_SYSTEM
from tests.bench.measure import median, process_cpu, ratio, rotated
from tests.bench.proxy_latency import (
    CONCURRENCY,
    RESPONSES,
    STREAM_TOKENS,
    BenchError,
    Target,
    _history,
    agent_throughput,
    codex_bodies,
    headers_for,
    throughput,
    varying_bodies,
)
from tests.bench.report import Section, Table, mark, ms, us, x
from tests.bench.servers import REPO, Server, Servers, python_module
from tests.bench.trees import Version, native_label, prepare

CPU_AIM = 1.10
"""Head's CPU per request at most this times base's."""
THROUGHPUT_AIM = 0.90
"""Head's throughput at least this times base's."""
TURNS = 120
"""Turns of one session of the restoring case."""
WINDOWS = ((26, 35), (56, 65), (111, 120))
"""Turns (first, last) over which the restoring case's CPU is read: around turns 30, 60 and 120."""
PREFIX_HEADER = "x-kvwarm-prefix"
_REPAIRED = re.compile(r"repaired=(\d+)")
LOG_DIR = REPO / "var" / "bench" / "versus"
VERSIONS = ("base", "head")
CONTROL = "base again"
"""``--control``: a second process of the base tree, measured like the others (throughput cases
only): its ratio to base is what this machine's noise alone makes of no difference."""


@dataclass(frozen=True)
class Plan:
    """How much each part measures (``--quick`` shrinks it)."""

    rounds: int = 7
    round_seconds: float = 2.0
    sessions: int = 32
    """Sessions of the restoring case run at a time, in lock step (one request each per turn)."""
    session_rounds: int = 3

    @classmethod
    def quick(cls) -> Plan:
        return cls(rounds=3, round_seconds=1.0, sessions=12, session_rounds=2)


def log(step: str) -> None:
    print(f"[bench] versus: {step}", file=sys.stderr, flush=True)


# -- the two versions ------------------------------------------------------------------------------


def start_kvwarm(group: Servers, version: Version, upstream: str) -> Server:
    return group.start(
        "kvwarm-" + version.name.replace(" ", "-"),
        python_module("proxy", "serve", "--port", "{port}", "--upstream", upstream, "--store", "memory"),
        "/readyz",
        env={"KVWARM_LOG_LEVEL": "WARNING"},
        unset=("KVWARM_PURE",),
        tree=version.tree,
    )


# -- the restoring case: sessions whose serializer reorders every earlier call's arguments ------------


def _arguments(k: int) -> tuple[str, dict[str, Any]]:
    """Tool call ``k``'s name and arguments (two or three keys, so a reordering always shows)."""
    module = f"src/module_{k % 17}.py"
    match k % 4:
        case 0:
            return "read_file", {"path": module, "start_line": 10 * k + 1, "end_line": 10 * k + 60}
        case 1:
            return "search", {"query": f"compute_key_{k}", "regex": k % 2 == 0, "max_results": 20 + k % 5}
        case 2:
            return "run_tests", {"selector": f"tests/test_cache.py::test_case_{k}", "timeout": 30.5}
        case _:
            return "write_file", {"path": module, "content": f"def compute_key_{k}(x):\n    return hash(x)\n"}


def _turn_pair(k: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Turn ``k``'s assistant tool call (compact arguments, as providers write them) and its result."""
    name, args = _arguments(k)
    call_id = f"call_{k:03d}"
    arguments = json.dumps(args, separators=(",", ":"))
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    result = f"{name} -> ok, 3 matches in src/module_{k % 17}.py (line {k * 11})\n"
    return (
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    )


class SessionScript:
    """The request bodies of a scripted session of ``turns`` turns, serialized once.

    The request of turn ``n`` (1-based) carries the system prompt, the first user turn and the
    first ``n - 1`` (tool call, result) pairs: the last pair is new (sent as written), the
    ``n - 2`` before it were sent before; a drifting client re-sends those with the keys of each
    call's arguments in another order (a new order every turn), as
    :func:`tests.agents.args_keys_reordered` does."""

    USER = orjson.dumps({"role": "user", "content": "Find where the cache key is computed and fix every caller."})
    TAIL = b'],"tools":' + orjson.dumps(TOOLS) + b"}"
    HEAD = b'{"model":"kvwarm-sim","messages":['

    def __init__(self, turns: int) -> None:
        pairs = [_turn_pair(k) for k in range(turns)]
        self.clean = [orjson.dumps(a) + b"," + orjson.dumps(r) for a, r in pairs]
        self.drifted: dict[int, list[bytes]] = {}
        for n in range(3, turns + 1):
            calls = copy.deepcopy([a for a, _ in pairs[: n - 2]])
            reordered, _ = args_keys_reordered(calls, [], n)
            self.drifted[n] = [orjson.dumps(a) + b"," + orjson.dumps(r) for a, (_, r) in zip(reordered, pairs, strict=False)]

    @staticmethod
    def system(label: str) -> bytes:
        return orjson.dumps({"role": "system", "content": f"{SYSTEM}\nSession {label}."})

    def body(self, system: bytes, n: int, drifted: bool) -> bytes:
        resent = self.drifted.get(n, []) if drifted else self.clean[: max(n - 2, 0)]
        new = self.clean[n - 2 : n - 1] if n >= 2 else []
        return self.HEAD + b",".join([system, self.USER, *resent, *new]) + self.TAIL


async def _post_repaired(target: Target, body: bytes, headers: dict[str, str]) -> int:
    """Send one request; the ``repaired=`` count of its ``x-kvwarm-prefix`` header (-1 without one)."""
    target.requests += 1
    async with target.session.post(target.chat_url, data=body, headers=headers) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise BenchError(f"{target.name} answered {resp.status}: {raw[:300]!r}")
        found = _REPAIRED.search(resp.headers.get(PREFIX_HEADER, ""))
    return int(found[1]) if found else -1


@dataclass
class Window:
    """One round's reading of a window of turns."""

    cpu: float
    """CPU seconds of the proxy's process over the window."""
    requests: int
    repaired: list[int]
    """The ``repaired=`` count of each request."""


async def session_round(target: Target, script: SessionScript, sessions: int, drifted: bool, label: str) -> dict[int, Window]:
    """``sessions`` new sessions of :data:`TURNS` turns, in lock step (each turn's requests sent
    together); a reading of each of :data:`WINDOWS`, keyed by its last turn."""
    systems = [SessionScript.system(f"{s} of {label}") for s in range(sessions)]
    headers = headers_for("restore")
    out: dict[int, Window] = {}
    start: tuple[float | None, int] = (None, 0)
    repaired: list[int] = []
    for n in range(1, TURNS + 1):
        window = next((w for w in WINDOWS if w[0] <= n <= w[1]), None)
        if window is not None and n == window[0]:
            start, repaired = (process_cpu(target.pid or 0), target.requests), []
        counts = await asyncio.gather(*(_post_repaired(target, script.body(s, n, drifted), headers) for s in systems))
        if window is None:
            continue
        repaired.extend(counts)
        cpu0, n0 = start
        cpu1 = process_cpu(target.pid or 0) if n == window[1] else None
        if cpu0 is not None and cpu1 is not None:
            out[n] = Window(cpu1 - cpu0, target.requests - n0, repaired)
    return out


# -- the throughput cases ---------------------------------------------------------------------------

CaseRun = Callable[[Target, float, str], Awaitable[float]]
"""(target, seconds, round label) -> requests/s."""


@dataclass
class Samples:
    rps: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    """CPU seconds of the proxy process per request, one value per round."""


def throughput_cases() -> dict[str, CaseRun]:
    """The cases of :mod:`tests.bench.proxy_latency` at concurrency 32, by label (bodies built once)."""
    short = _history(8, 2048, seed=1, system=SHORT_SYSTEM)
    long = _history(100, 200 * 1024, seed=2)
    small = varying_bodies(short, 400)
    large = varying_bodies(long, 120)
    tokens = varying_bodies(short, 400, stream=True, max_tokens=STREAM_TOKENS)
    codex = codex_bodies(400)

    def bodies(items: list[bytes], tenant: str, path: str = "/chat/completions") -> CaseRun:
        return lambda target, seconds, _: throughput(target, items, seconds, headers_for(tenant), path)

    def agents(target: Target, seconds: float, label: str) -> Awaitable[float]:
        return agent_throughput(target, seconds, headers_for("agents"), label)

    return {
        f"{len(small[0]) / 1024:.1f} KiB conversation, last turn changed": bodies(small, "small"),
        f"{len(large[0]) / 1024:.0f} KiB conversation, last turn changed": bodies(large, "large"),
        f"streaming {STREAM_TOKENS} tokens, a chunk each, {len(tokens[0]) / 1024:.1f} KiB": bodies(tokens, "tokens"),
        "agent loops (growing conversation, ~10→20 KiB)": agents,
        f"Responses API, a Codex CLI request ({len(codex[0]) / 1024:.0f} KiB), streamed": bodies(codex, "codex", RESPONSES),
    }


async def case_rounds(targets: list[Target], run: CaseRun, plan: Plan) -> dict[str, Samples]:
    """Rounds of one case, the targets in rotating order, after a short warm-up of each."""
    for target in targets:
        await run(target, 0.3, "warm-up")
    samples = {t.name: Samples() for t in targets}
    for i in range(plan.rounds):
        for target in rotated(targets, i):
            cpu0, n0 = process_cpu(target.pid or 0), target.requests
            rps = await run(target, plan.round_seconds, f"round {i}")
            cpu1 = process_cpu(target.pid or 0)
            samples[target.name].rps.append(rps)
            if cpu0 is not None and cpu1 is not None:
                samples[target.name].cpu.append((cpu1 - cpu0) / (target.requests - n0))
    return samples


# -- the run ------------------------------------------------------------------------------------------


@dataclass
class Results:
    cases: dict[str, dict[str, Samples]] = field(default_factory=dict)
    """case -> version -> samples."""
    sessions: dict[tuple[str, bool], list[dict[int, Window]]] = field(default_factory=dict)
    """(version, drifted) -> one reading per round."""


async def measure(endpoints: dict[str, Server], plan: Plan) -> Results:
    results = Results()
    async with contextlib.AsyncExitStack() as stack:
        targets = []
        for name, server in endpoints.items():
            connector = aiohttp.TCPConnector(limit=CONCURRENCY * 2)
            session = await stack.enter_async_context(aiohttp.ClientSession(connector=connector))
            targets.append(Target(name, server.base_url, session, server.proc.pid))
        for label, run in throughput_cases().items():
            log(label)
            samples = results.cases[label] = await case_rounds(targets, run, plan)
            log("  " + "; ".join(f"{n}: CPU/req {ms(median(v.cpu))}, {median(v.rps):.0f} req/s" for n, v in samples.items()))
        log(f"restoring: {plan.sessions} sessions × {TURNS} turns, {plan.session_rounds} rounds")
        script = SessionScript(TURNS)
        versions = [t for t in targets if t.name in VERSIONS]
        for target in versions:  # warm-up: each version's first sessions (not counted)
            await session_round(target, script, 2, True, "warm-up")
        for r in range(plan.session_rounds):
            for drifted in rotated([False, True], r):
                for target in rotated(versions, r):
                    label = f"round {r}, {'drifted' if drifted else 'clean'}"
                    reading = await session_round(target, script, plan.sessions, drifted, label)
                    results.sessions.setdefault((target.name, drifted), []).append(reading)
                    log(f"  {target.name}, {label}: " + ", ".join(
                        f"turns ≤{n} {ms(w.cpu / w.requests)}/req" for n, w in reading.items()))
    return results


def _run_client(endpoints: dict[str, Server], plan: Plan) -> Results:
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(measure(endpoints, plan))


def run(base: str, head: str = "HEAD", quick: bool = False, trees: Path | None = None, control: bool = False) -> Section:
    """``control``: also measure a second process of ``base`` (:data:`CONTROL`)."""
    started = time.perf_counter()
    plan = Plan.quick() if quick else Plan()
    with contextlib.ExitStack() as stack:
        root = trees or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvwarm-versus-")))
        versions = [prepare(name, commit, root, log) for name, commit in zip(VERSIONS, (base, head), strict=True)]
        if control:
            versions.append(dataclasses.replace(versions[0], name=CONTROL))
        group = stack.enter_context(Servers(LOG_DIR))
        echo = group.start(
            "echo-upstream", python_module("tests.bench.proxy_latency", "--echo-upstream", "--port", "{port}"), "/v1/models"
        )
        endpoints = {v.name: start_kvwarm(group, v, echo.base_url) for v in versions}
        natives = {name: native_label(server) for name, server in endpoints.items()}
        log(f"started: {', '.join(f'{n} ({natives[n]})' for n in endpoints)}")
        results = _run_client(endpoints, plan)
        for server in group.started:
            if server.proc.poll() is not None:
                raise BenchError(f"{server.name} died during the benchmark:\n{server.log_tail()}")
    return report(results, versions, natives, plan, time.perf_counter() - started)


# -- the report ---------------------------------------------------------------------------------------


def _spread(values: Sequence[float]) -> str:
    """The median of the per-round ratios, and their range."""
    return f"{median(values):.2f} ({min(values):.2f}–{max(values):.2f})" if values else "n/a"


def _paired(samples: dict[str, Samples], attr: str) -> list[float]:
    """Head ÷ base of each round (the two measured back to back)."""
    base, head = getattr(samples["base"], attr), getattr(samples["head"], attr)
    return [ratio(h, b) for b, h in zip(base, head, strict=False)]


def cases_table(results: Results, plan: Plan, misses: list[str]) -> Table:
    table = Table(
        f"CPU per request and throughput, {CONCURRENCY} concurrent clients (head ÷ base)",
        ["case", "base CPU/req", "head CPU/req", "head ÷ base", f"≤{CPU_AIM:.2f}x", "per round",
         "base req/s", "head req/s", "head ÷ base", f"≥{THROUGHPUT_AIM:.2f}x", "per round"],
    )
    controlled = any(CONTROL in samples for samples in results.cases.values())
    if controlled:
        table.columns += [f"control: {CONTROL} ÷ base, CPU", "req/s"]
    for label, samples in results.cases.items():
        cpu = {v: median(samples[v].cpu) for v in VERSIONS}
        rps = {v: median(samples[v].rps) for v in VERSIONS}
        cpu_r, rps_r = ratio(cpu["head"], cpu["base"]), ratio(rps["head"], rps["base"])
        if not cpu_r <= CPU_AIM:
            misses.append(f"CPU per request, {label}: {x(cpu_r)}")
        if not rps_r >= THROUGHPUT_AIM:
            misses.append(f"throughput, {label}: {x(rps_r)}")
        table.add(
            label, ms(cpu["base"]), ms(cpu["head"]), x(cpu_r), mark(cpu_r <= CPU_AIM), _spread(_paired(samples, "cpu")),
            f"{rps['base']:.0f}", f"{rps['head']:.0f}", x(rps_r), mark(rps_r >= THROUGHPUT_AIM), _spread(_paired(samples, "rps")),
        )
        if controlled:
            again = samples[CONTROL]
            table.rows[-1] += [x(ratio(median(again.cpu), cpu["base"])), x(ratio(median(again.rps), rps["base"]))]
    table.notes.append(
        f"Medians of {plan.rounds} rounds × {plan.round_seconds:g} s per version, the versions in rotating order "
        "(base, head / head, base / ...); \"per round\": head ÷ base of each round (the pair measured back to back), "
        "median (range): load from other processes moves both figures from round to round. CPU: user + system "
        "of the proxy's process (/proc, 10 ms ticks) over the round, ÷ its requests."
    )
    if controlled:
        table.notes.append(
            f"Control: a second process of the base tree ({CONTROL}), in the same rotation: base against itself, "
            "the noise of this machine and method."
        )
    return table


def _window(results: Results, version: str, drifted: bool, turn: int) -> tuple[float, float]:
    """(CPU seconds per request, median values restored per request) over the window ending at
    ``turn``, pooled over the rounds: a window of cheap requests is only a few 10 ms ticks long."""
    readings = [r[turn] for r in results.sessions.get((version, drifted), []) if turn in r]
    requests = sum(w.requests for w in readings)
    cpu = sum(w.cpu for w in readings) / requests if requests else float("nan")
    return cpu, median([n for w in readings for n in w.repaired])


def sessions_table(results: Results, plan: Plan, misses: list[str]) -> Table:
    table = Table(
        f"Restoring values: {TURNS}-turn sessions re-sending every earlier tool call with its argument keys reordered",
        ["turns", "earlier tool calls", "restored per request (base / head)",
         "clean CPU/req base / head", "head ÷ base", "reordered CPU/req base / head", "head ÷ base",
         "per restored value base / head", "head ÷ base"],
    )
    for first, last in WINDOWS:
        row: dict[str, float] = {}
        for v in VERSIONS:
            row[f"clean {v}"] = _window(results, v, False, last)[0]
            row[f"drift {v}"], row[f"restored {v}"] = _window(results, v, True, last)
            row[f"value {v}"] = ratio(row[f"drift {v}"] - row[f"clean {v}"], row[f"restored {v}"])
        value_r = ratio(row["value head"], row["value base"])
        if last == WINDOWS[-1][1] and not value_r <= 1.0:
            misses.append(f"cost per restored value at turns {first}–{last}: {x(value_r)}")
        table.add(
            f"{first}–{last}", f"{first - 2}–{last - 2}", f"{row['restored base']:.0f} / {row['restored head']:.0f}",
            f"{ms(row['clean base'])} / {ms(row['clean head'])}", x(ratio(row["clean head"], row["clean base"])),
            f"{ms(row['drift base'])} / {ms(row['drift head'])}", x(ratio(row["drift head"], row["drift base"])),
            f"{us(row['value base'])} / {us(row['value head'])}", x(value_r),
        )
    table.notes.append(
        f"{plan.sessions} sessions at a time, in lock step (each turn's requests sent together), new sessions every "
        f"round; {plan.session_rounds} rounds, the versions and the two variants in rotating order; CPU per request "
        "pooled over the rounds (the process's CPU over each window's requests ÷ their number). "
        "Turn n re-sends the n − 2 earlier (tool call, result) pairs and adds one new pair; the reordered sessions "
        "re-send each earlier call's arguments with their keys in a new order every turn. \"restored\": the "
        "median `repaired=` of the `x-kvwarm-prefix` header. Per restored value: (reordered − clean) ÷ restored."
    )
    table.notes.append(
        "The client writes the history itself (the echo upstream's reply is not the next tool call), so every "
        "request of both variants breaks at its new pair (`assistant_modified`), for both versions alike."
    )
    return table


def report(results: Results, versions: list[Version], natives: dict[str, str], plan: Plan, seconds: float) -> Section:
    misses: list[str] = []
    tables = [cases_table(results, plan, misses), sessions_table(results, plan, misses)]
    tables[0].notes.append(
        "base: " + versions[0].label + f", {natives['base']}; head: " + versions[1].label + f", {natives['head']}. "
        "Each extracted with `git archive`, compiled in its own tree and served from it (memory store, "
        "the echo upstream of tests/bench/proxy_latency.py)."
    )
    findings = [
        "Head misses the aim on: " + "; ".join(misses) + "." if misses
        else f"Head meets every aim: CPU per request ≤{CPU_AIM:.2f}x, throughput ≥{THROUGHPUT_AIM:.2f}x, "
        "a restored value no dearer."
    ]
    if len(set(natives.values())) != 1:
        findings.append(f"The two versions did not run the same way ({natives}): the comparison is not like for like.")
    title = f"Before and after: {versions[0].commit[:7]} → {versions[1].commit[:7]}"
    return Section(title, tables, findings, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.versus", description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (e.g. 5e389bf)")
    parser.add_argument("--head", default="HEAD", help="the commit measured against it (default HEAD)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and sessions")
    parser.add_argument("--trees", type=Path, help="keep the extracted, compiled trees here (reused next time)")
    parser.add_argument("--control", action="store_true", help=f"also measure a second base process ({CONTROL!r})")
    args = parser.parse_args(argv)
    print(run(args.base, args.head, args.quick, args.trees.resolve() if args.trees else None, args.control).markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
