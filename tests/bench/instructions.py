"""Instructions per request: two versions of kvwarm under callgrind, the same requests, one run.

``python -m tests.bench.instructions --base COMMIT [--head COMMIT] [--quick] [--runs N] [--trees DIR]``
(``make bench-instructions BASE=COMMIT``).

Why instructions: on a shared 2-CPU machine a process's CPU time moves with whatever else runs,
by more than the few per cent a change is judged on. The instructions one process executes for a
fixed sequence of requests hardly depend on scheduling. What does -- how many turns of the event
loop a request takes, and how long glibc's malloc searches a heap whose layout follows how the
socket reads happened to be split -- shows as the run-to-run spread the report gives beside
each ratio (``--runs``).

How: each version is extracted from git with ``git archive`` (never the working tree, whose edits
in progress would make the figures move), compiled in its own tree (``python -m proxy.build
--if-stale``, as ``make compile`` does there) and served by one process run in and importing
from that tree (``python -m proxy serve --store memory``, ``KVWARM_LOG_LEVEL=WARNING``,
``PYTHONHASHSEED=0``) under ``valgrind --tool=callgrind --instr-atstart=no``, in front of the
echo upstream of :mod:`tests.bench.proxy_latency` (its own process, not under valgrind). This
process is the client. Each run of a version is a new kvwarm process and a new echo upstream;
the versions alternate (base, head / head, base / ...). Once kvwarm is ready, instrumentation is
turned on; each phase then sends its warm-up requests, dumps (``callgrind_control -d``, which
zeroes the counts), sends its requests one at a time and dumps again: a phase's figure is its
second dump's instruction count over its requests. A dump whose summary is not the sum of its
costs is refused (:func:`read_dumps`). The dumps stay in ``var/bench/instructions/`` (a directory
per version and run) for ``callgrind_annotate``.

Phases (:func:`phases`): the ~2 KiB and ~200 KiB conversations of the proxy benchmark re-sent
with their last turn changed; agent loops (:class:`tests.agents.Agent`, each session new); the
~2 KiB conversation answered by a 200-token stream; and drifting agents whose history holds
tool calls with several argument keys and who re-send every earlier call with its keys
reordered (:func:`tests.agents.args_keys_reordered`), so kvwarm restores each to the form it
first saw (the ``repaired=`` count of the ``x-kvwarm-prefix`` header is reported per request).

Timers. kvwarm runs wall-clock tasks that are not part of any request: the store maintenance
(eviction every ``proxy.app.MAINTENANCE_INTERVAL`` seconds) and the live page's counter sampler
(``proxy.web.routes._sample_every_minute``). Callgrind slows the process so much
that a phase spans several of their periods, and would count however many happened to fire in
it; no setting moves them (``proxy/config.py`` has none). kvwarm is therefore started through
:data:`LAUNCHER`, which sets the interval to 10⁹ s and replaces the sampler by a task that only
waits before it runs ``python -m proxy``; it stops with an error when a version lacks either
name (a rename must be followed here, not measured by accident). For the same reason it sets
``upstream.idle_connection_timeout`` (where a version has it: a few seconds by default) to an
hour: the slowed process must not close and reopen its upstream connection between two requests
only because a ``callgrind_control`` call in between took long. The timers a request arms and
cancels itself (the pool's idle expiry, aiohttp's keep-alive) are counted, as they should be.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tests.agents import SYSTEM, Agent, Drift, args_keys_reordered, no_drift
from tests.bench.conversations import SHORT_SYSTEM
from tests.bench.proxy_latency import (
    STREAM_TOKENS,
    BenchError,
    _history,
    headers_for,
    varying_bodies,
)
from tests.bench.report import Section, Table, kib
from tests.bench.servers import HOST, REPO, Server, Servers, free_port, python_module
from tests.bench.trees import Version, native_label, prepare, tree_env

LOG_DIR = REPO / "var" / "bench" / "instructions"
VERSIONS = ("base", "head")
PREFIX_HEADER = "x-kvwarm-prefix"
_REPAIRED = re.compile(r"repaired=(\d+)")
_TRIGGER = re.compile(r"^desc: Trigger: .*dump (\S+)$", re.M)
_SUMMARY = re.compile(r"^summary: (\d+)$", re.M)
_TOTALS = re.compile(r"^totals: (\d+)$", re.M)
READY_SECONDS = 900.0
"""kvwarm's start-up under valgrind (imports, the tokenizer) is slow; a loaded machine slower."""
CONTROL_SECONDS = 300.0
SETTLE_SECONDS = 1.0
"""Idle time before each dump (see :func:`dump`)."""

LAUNCHER = """\
import asyncio, dataclasses, os, runpy, sys
import proxy.app, proxy.config, proxy.web.routes
for module, name in ((proxy.app, "MAINTENANCE_INTERVAL"), (proxy.web.routes, "_sample_every_minute")):
    if not hasattr(module, name):
        sys.exit(f"tests.bench.instructions: {module.__name__}.{name} is gone; update its LAUNCHER")
async def _waits(app):
    await asyncio.Event().wait()
proxy.app.MAINTENANCE_INTERVAL = 1e9
proxy.web.routes._sample_every_minute = _waits
if "idle_connection_timeout" in {f.name for f in dataclasses.fields(proxy.config.UpstreamSettings)}:
    os.environ["KVWARM_UPSTREAM_IDLE_CONNECTION_TIMEOUT"] = "3600"
sys.argv[0] = "proxy"
runpy.run_module("proxy", run_name="__main__", alter_sys=True)
"""
"""``python -c LAUNCHER serve ...``: ``python -m proxy serve ...`` with the wall-clock timers that
serve no request pushed out of the measurement (see the module's docstring)."""


@dataclass(frozen=True)
class Plan:
    """Requests per phase (``--quick`` shrinks them) and warm-ups before each. A phase sends
    fewer requests than the metrics list before applying their batch (see :func:`drive`)."""

    small: int = 200
    large: int = 40
    tokens: int = 50
    sessions: int = 2
    """Agent sessions (plain, and drifting), each new."""
    turns: int = 25
    warmup: int = 8

    @classmethod
    def quick(cls) -> Plan:
        return cls(small=40, large=8, tokens=10, sessions=1, turns=12, warmup=4)


def log(step: str) -> None:
    print(f"[bench] instructions: {step}", file=sys.stderr, flush=True)


# -- the versions ------------------------------------------------------------------------------------


# -- kvwarm under callgrind --------------------------------------------------------------------------


def _wait_ready(server: Server, path: str) -> None:
    deadline = time.monotonic() + READY_SECONDS
    url = f"http://{HOST}:{server.port}{path}"
    while True:
        with contextlib.suppress(urllib.error.URLError, OSError), urllib.request.urlopen(url, timeout=5) as resp:
            if resp.status == 200:
                return
        if server.proc.poll() is not None:
            raise BenchError(f"{server.name} exited with status {server.proc.returncode}:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            raise BenchError(f"{server.name} not ready after {READY_SECONDS:.0f} s:\n{server.log_tail()}")
        time.sleep(0.5)


def _stop(server: Server) -> None:
    """Terminate (kvwarm shuts down, valgrind writes its final dump, which is not read), else kill."""
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=30)


@contextlib.contextmanager
def kvwarm_under_callgrind(version: Version, upstream: str, out: Path) -> Iterator[Server]:
    """kvwarm of ``version`` serving on a free port, instrumentation off until turned on; its
    dumps and its log go to ``out``."""
    port = free_port()
    argv = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out / 'callgrind.out'}",
        sys.executable, "-c", LAUNCHER, "serve", "--port", str(port), "--upstream", upstream, "--store", "memory",
    ]
    log_path = out / "kvwarm.log"
    with log_path.open("wb") as sink:
        proc = subprocess.Popen(
            argv, cwd=version.tree, env=tree_env(version.tree), stdout=sink, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    server = Server(f"kvwarm-{version.name}", proc, port, log_path)
    try:
        _wait_ready(server, "/readyz")
        yield server
    finally:
        _stop(server)


async def callgrind_control(pid: int, *args: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "callgrind_control", *args, str(pid), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), CONTROL_SECONDS)
    if proc.returncode != 0:
        raise BenchError(f"callgrind_control {' '.join(args)} {pid} failed: {err.decode(errors='replace')}")


def read_dumps(out: Path) -> dict[str, int]:
    """Instructions of each ``callgrind_control -d NAME`` dump in ``out``, by NAME. A dump whose
    summary differs from the sum of its costs (``totals``) is refused: callgrind lost track."""
    counts: dict[str, int] = {}
    for path in sorted(out.glob("callgrind.out.*")):
        text = path.read_text(errors="replace")
        trigger, summary, totals = _TRIGGER.search(text), _SUMMARY.search(text), _TOTALS.search(text)
        if trigger is None or summary is None:
            continue
        if totals is not None and totals[1] != summary[1]:
            raise BenchError(f"{path}: summary {summary[1]} but totals {totals[1]}: the count is not to be trusted")
        counts[trigger[1]] = int(summary[1])
    return counts


# -- the phases --------------------------------------------------------------------------------------


@dataclass
class Client:
    """Sends one request at a time and keeps what the phases read off the responses."""

    session: aiohttp.ClientSession
    url: str
    requests: int = 0
    repaired: list[int] = field(default_factory=list)
    """Each response's ``repaired=`` count (-1: no ``x-kvwarm-prefix`` header)."""

    async def send(self, body: bytes, tenant: str) -> bytes:
        self.requests += 1
        async with self.session.post(self.url, data=body, headers=headers_for(tenant)) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise BenchError(f"{self.url} answered {resp.status}: {raw[:300]!r}")
            found = _REPAIRED.search(resp.headers.get(PREFIX_HEADER, ""))
        self.repaired.append(int(found[1]) if found else -1)
        return raw

    def agent(self, tenant: str, system: str, drift: Drift, history: list[dict[str, Any]] | None) -> Agent:
        async def post(request: dict[str, Any]) -> dict[str, Any]:
            reply: dict[str, Any] = orjson.loads(await self.send(orjson.dumps(request), tenant))
            return reply

        return Agent(post=post, drift=drift, system=system, history=history or [])


Steps = Callable[[Client], Awaitable[None]]


@dataclass(frozen=True)
class Phase:
    name: str
    label: str
    warm: Steps
    """Requests whose count is dumped and dropped: they warm the code paths and the phase's
    conversations (a conversation's first request records it whole, once)."""
    run: Steps


async def resend(client: Client, bodies: Sequence[bytes], tenant: str) -> None:
    for body in bodies:
        await client.send(body, tenant)


async def sessions(client: Client, tenant: str, label: str, count: int, turns: int, drift: Drift, seeded: bool) -> None:
    """``count`` agent sessions of ``turns`` turns, each new (its own system prompt). ``seeded``:
    each starts from a recorded tool-using history (calls of two or three argument keys), so a
    drift of the arguments has something to reorder from its second turn on."""
    for k in range(count):
        system = f"{SYSTEM}\nSession {label} {k}."
        history = _history(12, 6 * 1024, seed=3 + k, system=system) if seeded else None
        agent = client.agent(tenant, system, drift, history)
        for _ in range(turns):
            await agent.step()


def phases(plan: Plan) -> list[Phase]:
    short = _history(8, 2048, seed=1, system=SHORT_SYSTEM)
    long = _history(100, 200 * 1024, seed=2)
    small = varying_bodies(short, plan.small + plan.warmup)
    large = varying_bodies(long, plan.large + plan.warmup)
    tokens = varying_bodies(short, plan.tokens + plan.warmup, stream=True, max_tokens=STREAM_TOKENS)
    agents = partial(sessions, tenant="agent", drift=no_drift, seeded=False)
    drifting = partial(sessions, tenant="drift", drift=args_keys_reordered, seeded=True)
    warm_turns = max(3, plan.warmup)
    return [
        Phase(
            "small", f"{kib(len(small[0]))} conversation, last turn changed",
            partial(resend, bodies=small[plan.small :], tenant="small"), partial(resend, bodies=small[: plan.small], tenant="small"),
        ),
        Phase(
            "large", f"{kib(len(large[0]))} conversation, last turn changed",
            partial(resend, bodies=large[plan.large :], tenant="large"), partial(resend, bodies=large[: plan.large], tenant="large"),
        ),
        Phase(
            "agent", f"agent loop, {plan.sessions} new session(s) × {plan.turns} turns",
            partial(agents, label="warm-up", count=1, turns=warm_turns), partial(agents, label="measured", count=plan.sessions, turns=plan.turns),
        ),
        Phase(
            "tokens", f"{kib(len(tokens[0]))} conversation answered by {STREAM_TOKENS} streamed tokens",
            partial(resend, bodies=tokens[plan.tokens :], tenant="tokens"), partial(resend, bodies=tokens[: plan.tokens], tenant="tokens"),
        ),
        Phase(
            "drift", f"drifting agent (argument keys reordered, repaired), {plan.sessions} session(s) × {plan.turns} turns",
            partial(drifting, label="warm-up", count=1, turns=warm_turns), partial(drifting, label="measured", count=plan.sessions, turns=plan.turns),
        ),
    ]


@dataclass(frozen=True)
class Counted:
    """One version's reading of one phase."""

    requests: int
    instructions: int
    repaired: float
    """Values restored per request (the mean ``repaired=`` count)."""

    @property
    def per_request(self) -> float:
        return self.instructions / self.requests


async def dump(pid: int, name: str) -> None:
    """Dump (and zero) the counts once kvwarm is idle: the work a request leaves to the end of its
    event-loop iteration (its report, applying observations) belongs before the dump, and comes
    within microseconds of its response, far less than :data:`SETTLE_SECONDS` even under callgrind."""
    await asyncio.sleep(SETTLE_SECONDS)
    await callgrind_control(pid, "-d", name)


async def drive(base_url: str, pid: int, chosen: list[Phase]) -> dict[str, tuple[int, float]]:
    """Instrumentation on once, then for each phase: its warm-up, a read of ``/metrics``, a dump,
    its requests, its dump. (requests, values repaired per request) by phase.

    The read applies the observations the requests before left pending, as a scrape does, so
    each phase starts from an empty batch whatever ran before it (the batch is otherwise applied
    once a series has listed a few hundred observations, more requests than a phase of
    :class:`Plan` sends: such a lump would land in whichever phase reached the count). Not ``-i off``
    between phases nor ``-z`` before one: either leaves callgrind's later dumps inconsistent (a
    summary that is not the sum of its costs, at times by orders of magnitude)."""
    out: dict[str, tuple[int, float]] = {}
    timeout = aiohttp.ClientTimeout(total=CONTROL_SECONDS * 2)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        client = Client(session, base_url + "/v1/chat/completions")
        await callgrind_control(pid, "-i", "on")
        for phase in chosen:
            log(f"  {phase.name}: warm-up")
            await phase.warm(client)
            async with session.get(base_url + "/metrics") as resp:
                await resp.read()
            await dump(pid, f"warm-up-{phase.name}")
            n0, r0 = client.requests, len(client.repaired)
            log(f"  {phase.name}: measuring")
            await phase.run(client)
            await dump(pid, phase.name)
            repaired = client.repaired[r0:]
            out[phase.name] = (client.requests - n0, sum(max(r, 0) for r in repaired) / max(len(repaired), 1))
    return out


@dataclass(frozen=True)
class Reading:
    """One run of one version: its phases, and its build as its ``kvwarm_build_info`` says."""

    phases: dict[str, Counted]
    native: str


def measure(version: Version, plan: Plan, run: int) -> Reading:
    """The version's phases under callgrind, against an echo upstream of their own."""
    out = LOG_DIR / f"{version.name}-{run + 1}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    chosen = phases(plan)
    with Servers(out) as group:
        echo = group.start(
            "echo-upstream", python_module("tests.bench.proxy_latency", "--echo-upstream", "--port", "{port}"),
            "/v1/models", env={"KVWARM_PURE": "1"},
        )
        log(f"run {run + 1}: {version.name} {version.commit[:7]} under callgrind")
        with kvwarm_under_callgrind(version, echo.base_url, out) as kvwarm:
            native = native_label(kvwarm)
            sent = asyncio.run(drive(f"http://{HOST}:{kvwarm.port}", kvwarm.proc.pid, chosen))
    counts = read_dumps(out)
    missing = [p.name for p in chosen if p.name not in counts]
    if missing:
        raise BenchError(f"{version.name}: no callgrind dump for {', '.join(missing)} in {out}")
    return Reading({p.name: Counted(sent[p.name][0], counts[p.name], sent[p.name][1]) for p in chosen}, native)


# -- the report --------------------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _spread(readings: dict[str, list[Reading]], phase: str) -> float | None:
    """The largest difference between two runs of one version, relative to their smaller figure
    (None with one run each)."""
    if len(readings["base"]) < 2:
        return None
    worst = 0.0
    for runs in readings.values():
        figures = [r.phases[phase].per_request for r in runs]
        worst = max(worst, max(figures) / min(figures) - 1)
    return worst


def _section(versions: dict[str, Version], readings: dict[str, list[Reading]], plan: Plan, seconds: float) -> Section:
    b, h = versions["base"].commit[:7], versions["head"].commit[:7]
    runs = len(readings["base"])
    table = Table(
        "Instructions per request, one kvwarm process under callgrind",
        ["phase", "requests", f"base `{b}`", f"head `{h}`", "head / base", "run-to-run spread", "values repaired per request (base / head)"],
    )
    ratios: dict[str, float] = {}
    noise: list[str] = []
    labels = {p.name: p.label for p in phases(plan)}
    for name, label in labels.items():
        before = _mean([r.phases[name].per_request for r in readings["base"]])
        after = _mean([r.phases[name].per_request for r in readings["head"]])
        ratios[name] = after / before
        repaired = [readings[v][0].phases[name].repaired for v in VERSIONS]
        spread = _spread(readings, name)
        if spread is not None and abs(ratios[name] - 1) <= spread:
            noise.append(label)
        table.add(
            label, readings["base"][0].phases[name].requests, f"{before:,.0f}", f"{after:,.0f}",
            f"{ratios[name]:.3f} ({(ratios[name] - 1) * 100:+.1f} %)", "–" if spread is None else f"{spread * 100:.2f} %",
            " / ".join(f"{r:.1f}" for r in repaired) if any(repaired) else "–",
        )
    native = {v: sorted({r.native for r in readings[v]}) for v in VERSIONS}
    for key in VERSIONS:
        v = versions[key]
        table.notes.append(
            f"{key}: `{v.commit[:7]}` {v.subject[:70]}; runs as {' / '.join(native[key])} "
            f"(`kvwarm_build_info`), {v.compiled} modules compiled with mypyc"
        )
    table.notes.append(
        f"Mean of {runs} run(s) per version, versions alternating; each run is a new kvwarm process. Instructions "
        "of the kvwarm process only (callgrind's Ir: its Python, compiled modules and libraries), from the end "
        f"of a phase's warm-up to {SETTLE_SECONDS:g} s after its last response, over its requests; the echo upstream "
        "and this client are other processes. Run-to-run spread: the largest difference between two runs of one "
        "version. Store maintenance and the page's sampler are pushed out of the run (module docstring)."
    )
    largest = max(ratios, key=lambda n: abs(ratios[n] - 1))
    findings = [
        f"Head runs {min(ratios.values()):.3f}-{max(ratios.values()):.3f}x base's instructions per request; "
        f"the largest difference: {labels[largest]} ({(ratios[largest] - 1) * 100:+.1f} %)."
    ]
    if noise:
        findings.append(f"Within the run-to-run spread (not a difference): {'; '.join(noise)}.")
    if native["base"] != native["head"] or native["base"] != ["compiled"]:
        findings.append(f"Unlike builds (base {native['base']}, head {native['head']}): the ratios do not compare like with like.")
    return Section("Instructions per request (callgrind), base against head", [table], findings, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.instructions", description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--head", default="HEAD", help="the commit to judge (default HEAD, never the working tree)")
    parser.add_argument("--quick", action="store_true", help="fewer requests per phase")
    parser.add_argument("--runs", type=int, default=2, help="runs per version, alternating (default 2: the spread shows the noise)")
    parser.add_argument("--trees", type=Path, help="keep the extracted, compiled trees here for the next run")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("needs valgrind (callgrind and callgrind_control) on PATH")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    plan = Plan.quick() if args.quick else Plan()
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        root = args.trees or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvwarm-instructions-")))
        versions = {name: prepare(name, commit, root, log) for name, commit in zip(VERSIONS, (args.base, args.head), strict=True)}
        readings: dict[str, list[Reading]] = {name: [] for name in VERSIONS}
        for run in range(args.runs):
            for name in VERSIONS if run % 2 == 0 else VERSIONS[::-1]:
                readings[name].append(measure(versions[name], plan, run))
    report = _section(versions, readings, plan, time.perf_counter() - started).markdown()
    print(report)
    (LOG_DIR / "latest.md").write_text(report, encoding="utf-8")
    log(f"written to {LOG_DIR / 'latest.md'}; callgrind dumps and logs beside it, a directory per version and run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
