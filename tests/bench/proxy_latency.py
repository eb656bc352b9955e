"""Proxy overhead (issue 2): kvwarm vs direct vs a bare aiohttp pass-through, on real sockets.

Processes on loopback: the reference upstream (``python -m proxy upstream-sim``, OpenAI
cache mode, no artificial delays), kvwarm (``python -m proxy serve --store memory``,
``KVWARM_LOG_LEVEL=WARNING``), the bare pass-through of :mod:`tests.bench.passthrough`
(same event loop kind as kvwarm), and with ``--peers`` LiteLLM's proxy
(:mod:`tests.bench.peers`). This process is the client: aiohttp, keep-alive, one session
per target, on uvloop when installed.

Measured, every target in rotating order within each round (direct, bare, kvwarm /
bare, kvwarm, direct / ...):

- latency of non-streaming requests with a ~2 KB and a ~500 KB body (a realistic
  tool-using conversation, the same bytes every time: after the first request kvwarm
  matches everything, its steady state for a re-sent prefix);
- time to the first body byte of a streaming request (~2 KB body);
- a growing conversation: :class:`tests.agents.Agent` loops, one per target in lock
  step, each request re-sending the history plus the last reply and tool results
  (~10 kB system prompt, +2-3 messages per turn; kvwarm matches the prefix and records
  the new messages);
- throughput (requests/s) with 32 concurrent clients, ~2 KB and ~13 KB (20 messages) bodies.

Besides client-side times, the CPU time each proxy process spends per request is read
from ``/proc`` over every scenario: unlike latency on a shared 2-CPU machine, it does not
depend on when a process happened to be scheduled.

Added latency is a target's percentile minus direct's. The aim (issue 2): kvwarm's added
latency within 1.2x of the bare pass-through's, and its throughput at least the bare
pass-through's.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from tests.agents import SYSTEM, Agent
from tests.bench import peers
from tests.bench.conversations import chat_body, conversation, large_body, small_body
from tests.bench.measure import median, percentile, ratio, rotated
from tests.bench.passthrough import loop_kind
from tests.bench.report import Section, Table, mark, ms, x
from tests.bench.servers import REPO, Servers, python_module

ADDED_AIM = 1.2
"""kvwarm's added latency at most this times the bare pass-through's."""
THROUGHPUT_AIM = 1.0
"""kvwarm's throughput at least this times the bare pass-through's."""
CONCURRENCY = 32


def headers_for(tenant: str) -> dict[str, str]:
    """Each scenario is its own tenant (API key), as separate agents would be."""
    return {"Content-Type": "application/json", "Authorization": f"Bearer sk-bench-{tenant}"}

Endpoint = tuple[str, int | None, str | None]
"""(base URL, pid of the proxy process or None, Authorization override or None)."""


@dataclass(frozen=True)
class Plan:
    """How many samples each scenario takes (``--quick`` shrinks them)."""

    small: int = 400
    large: int = 40
    stream: int = 300
    agent_runs: int = 4
    agent_turns: int = 25
    rounds: int = 5
    round_seconds: float = 2.0
    warmup: int = 15

    @classmethod
    def quick(cls) -> Plan:
        return cls(small=150, large=15, stream=100, agent_runs=2, agent_turns=15, rounds=3, round_seconds=1.0, warmup=8)


@dataclass
class Target:
    name: str
    base_url: str
    session: aiohttp.ClientSession = field(repr=False)
    pid: int | None = None
    """The proxy's process (None for direct): its CPU time is read from /proc."""
    authorization: str | None = None
    """Replaces the scenario's ``Authorization`` (a peer that checks its own key)."""
    requests: int = 0
    """Requests sent so far (warm-ups included), for CPU time per request."""

    @property
    def chat_url(self) -> str:
        return self.base_url + "/chat/completions"

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        if self.authorization is None:
            return headers
        return {**headers, "Authorization": self.authorization}


class BenchError(RuntimeError):
    """A request of the benchmark failed: the numbers would be meaningless."""


async def _check(resp: aiohttp.ClientResponse) -> None:
    if resp.status != 200:
        text = (await resp.read())[:300]
        raise BenchError(f"{resp.url} answered {resp.status}: {text!r}")


async def request_latency(target: Target, body: bytes, headers: dict[str, str]) -> float:
    """Seconds from sending a request to the last byte of its response."""
    target.requests += 1
    headers = target.headers(headers)
    t0 = time.perf_counter()
    async with target.session.post(target.chat_url, data=body, headers=headers) as resp:
        await _check(resp)
        await resp.read()
    return time.perf_counter() - t0


async def first_byte(target: Target, body: bytes, headers: dict[str, str]) -> float:
    """Seconds from sending a streaming request to the first byte of its body (then drains it)."""
    target.requests += 1
    headers = target.headers(headers)
    t0 = time.perf_counter()
    async with target.session.post(target.chat_url, data=body, headers=headers) as resp:
        await _check(resp)
        first = await resp.content.readany()
        elapsed = time.perf_counter() - t0
        if not first:
            raise BenchError(f"{target.name}: empty stream")
        async for _ in resp.content.iter_any():
            pass
    return elapsed


async def sequential(
    targets: list[Target],
    fn: Callable[[Target, bytes, dict[str, str]], Awaitable[float]],
    body: bytes,
    n: int,
    warmup: int,
    tenant: str,
) -> dict[str, list[float]]:
    """``n`` samples per target, one target after another in rotating order."""
    headers = headers_for(tenant)

    async def one(target: Target) -> float:
        try:
            return await fn(target, body, headers)
        except aiohttp.ClientError as exc:
            raise BenchError(f"{target.name}: {exc!r}") from exc

    for target in targets:
        for _ in range(warmup):
            await one(target)
    samples: dict[str, list[float]] = {t.name: [] for t in targets}
    for i in range(n):
        for target in rotated(targets, i):
            samples[target.name].append(await one(target))
    return samples


async def agent_loops(targets: list[Target], runs: int, turns: int) -> dict[str, list[float]]:
    """Per-request latency of agents whose conversations grow turn by turn, one agent per target."""
    samples: dict[str, list[float]] = {t.name: [] for t in targets}
    headers = headers_for("agents")

    def poster(target: Target, record: bool) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]:
        async def post(request: dict[str, Any]) -> dict[str, Any]:
            data = orjson.dumps(request)
            target.requests += 1
            t0 = time.perf_counter()
            async with target.session.post(target.chat_url, data=data, headers=target.headers(headers)) as resp:
                await _check(resp)
                raw = await resp.read()
            if record:
                samples[target.name].append(time.perf_counter() - t0)
            result: dict[str, Any] = orjson.loads(raw)
            return result

        return post

    # One warm-up run (not recorded), then the measured runs; each run is a new session.
    for run in range(runs + 1):
        system = f"{SYSTEM}\nSession {run} of the benchmark."
        agents = [Agent(post=poster(t, record=run > 0), system=system) for t in targets]
        for turn in range(turns):
            for agent in rotated(agents, turn + run):
                await agent.step()
    return samples


async def throughput(target: Target, body: bytes, seconds: float, headers: dict[str, str]) -> float:
    """Requests/s completed by :data:`CONCURRENCY` clients sending ``body`` for ``seconds``."""
    headers = target.headers(headers)
    loop = asyncio.get_running_loop()
    stop = loop.time() + seconds
    done = 0

    async def worker() -> None:
        nonlocal done
        while loop.time() < stop:
            target.requests += 1
            async with target.session.post(target.chat_url, data=body, headers=headers) as resp:
                await _check(resp)
                await resp.read()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return done / (time.perf_counter() - t0)


async def throughput_rounds(targets: list[Target], body: bytes, plan: Plan, tenant: str) -> dict[str, list[float]]:
    headers = headers_for(tenant)
    for target in targets:
        await throughput(target, body, 0.3, headers)
    samples: dict[str, list[float]] = {t.name: [] for t in targets}
    for i in range(plan.rounds):
        for target in rotated(targets, i):
            samples[target.name].append(await throughput(target, body, plan.round_seconds, headers))
    return samples


@dataclass
class Results:
    latency: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """scenario -> target -> seconds per request."""
    throughput: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """scenario -> target -> requests/s per round."""
    body_sizes: dict[str, str] = field(default_factory=dict)
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)
    """scenario -> proxy -> CPU seconds (user + system) of its process per request."""


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) of a process and its direct children; None off Linux."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    try:
        pids = [pid, *_children(pid)]
        for p in pids:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    except (OSError, ValueError, IndexError):
        return None
    return total


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


class CpuMeter:
    """CPU time per request of each proxy process over one scenario."""

    def __init__(self, targets: list[Target]) -> None:
        self.targets = [t for t in targets if t.pid is not None]
        self.start = {t.name: (process_cpu(t.pid), t.requests) for t in self.targets if t.pid is not None}

    def per_request(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in self.targets:
            cpu0, n0 = self.start[t.name]
            cpu1 = process_cpu(t.pid) if t.pid is not None else None
            if cpu0 is not None and cpu1 is not None and t.requests > n0:
                out[t.name] = (cpu1 - cpu0) / (t.requests - n0)
        return out


async def _measure(urls: dict[str, Endpoint], plan: Plan, log: Callable[[str], None]) -> Results:
    results = Results()
    sessions = []
    targets: list[Target] = []
    for name, (url, pid, authorization) in urls.items():
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONCURRENCY * 2))
        sessions.append(session)
        targets.append(Target(name, url, session, pid, authorization))
    try:
        small, large, stream = small_body(), large_body(), small_body(stream=True)
        # Under 20 000 bytes: the reference upstream then parses it on its event loop, as the
        # 2 KB body (above, it moves the work to threads and its throughput changes character).
        medium = orjson.dumps(chat_body(conversation(20, 9_000, seed=3)))
        results.body_sizes = {
            "small": f"{len(small) / 1024:.1f} KiB", "large": f"{len(large) / 1024:.0f} KiB",
            "medium": f"{len(medium) / 1024:.1f} KiB",
        }
        log("latency, ~2 KB")
        meter = CpuMeter(targets)
        results.latency["small"] = await sequential(targets, request_latency, small, plan.small, plan.warmup, "small")
        results.cpu["small"] = meter.per_request()
        log("latency, ~500 KB")
        meter = CpuMeter(targets)
        results.latency["large"] = await sequential(targets, request_latency, large, plan.large, plan.warmup // 3 + 2, "large")
        results.cpu["large"] = meter.per_request()
        log("streaming, time to first byte")
        meter = CpuMeter(targets)
        results.latency["ttfb"] = await sequential(targets, first_byte, stream, plan.stream, plan.warmup, "stream")
        results.cpu["ttfb"] = meter.per_request()
        log("growing conversations (agents)")
        meter = CpuMeter(targets)
        results.latency["agent"] = await agent_loops(targets, plan.agent_runs, plan.agent_turns)
        results.cpu["agent"] = meter.per_request()
        log(f"throughput, concurrency {CONCURRENCY}")
        meter = CpuMeter(targets)
        results.throughput["small"] = await throughput_rounds(targets, small, plan, "small")
        results.cpu["throughput, small"] = meter.per_request()
        meter = CpuMeter(targets)
        results.throughput["medium"] = await throughput_rounds(targets, medium, plan, "medium")
        results.cpu["throughput, medium"] = meter.per_request()
    finally:
        for session in sessions:
            await session.close()
    return results


def _run_client(urls: dict[str, Endpoint], plan: Plan, log: Callable[[str], None]) -> Results:
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_measure(urls, plan, log))


def run(quick: bool = False, with_peers: bool = False) -> Section:
    started = time.perf_counter()
    plan = Plan.quick() if quick else Plan()

    def log(step: str) -> None:
        print(f"[bench] proxy overhead: {step}", file=sys.stderr, flush=True)

    peer_note: str | None = None
    log_dir = REPO / "var" / "bench"
    with Servers(log_dir) as group:
        sim = group.start(
            "upstream-sim", python_module("proxy", "upstream-sim", "--port", "{port}", "--cache", "openai"), "/v1/models"
        )
        urls: dict[str, Endpoint] = {"direct": (sim.base_url, None, None)}
        bare = group.start(
            "passthrough",
            python_module("tests.bench.passthrough", "--port", "{port}", "--upstream", sim.base_url),
            "/v1/models",
        )
        urls["bare"] = (bare.base_url, bare.proc.pid, None)
        kvwarm = group.start(
            "kvwarm",
            python_module("proxy", "serve", "--port", "{port}", "--upstream", sim.base_url, "--store", "memory"),
            "/readyz",
            env={"KVWARM_LOG_LEVEL": "WARNING"},
        )
        urls["kvwarm"] = (kvwarm.base_url, kvwarm.proc.pid, None)
        if with_peers:
            try:
                log("starting LiteLLM (installs it on first use)")
                litellm = peers.start_litellm(group, sim.base_url)
                urls["litellm"] = (litellm.base_url, litellm.proc.pid, f"Bearer {peers.master_key()}")
                peer_note = f"LiteLLM {peers.litellm_version()} proxy (`litellm --num_workers 1`, its own virtualenv)."
            except peers.PeerUnavailable as exc:
                peer_note = f"LiteLLM could not be run here: {exc}"
        results = _run_client(urls, plan, log)
        for server in group.started:
            if server.proc.poll() is not None and (server.name in urls or server.name == "upstream-sim"):
                raise BenchError(f"{server.name} died during the benchmark:\n{server.log_tail()}")
    return _section(results, list(urls), plan, peer_note, time.perf_counter() - started)


NOISE = 0.05e-3
"""Added latencies below 50 µs are within the noise of this machine: no ratio is taken."""


def _cell(value: float, base: float | None) -> str:
    text = ms(value)
    if base is not None:
        text += f" ({(value - base) * 1e3:+.2f})"
    return text


def _added_ratio(kvwarm: float, bare: float) -> tuple[str, str, bool | None]:
    """(ratio text, aim mark, met?) for kvwarm's added latency against bare's."""
    if bare < NOISE:
        # Negative or tiny: the percentile's noise exceeds the proxy's cost; no ratio.
        return "noise", "–", None
    r = kvwarm / bare
    return x(r), mark(r <= ADDED_AIM), r <= ADDED_AIM


def _section(results: Results, names: list[str], plan: Plan, peer_note: str | None, seconds: float) -> Section:
    proxies = [n for n in names if n != "direct"]
    others = [n for n in proxies if n not in ("bare", "kvwarm")]
    sizes = results.body_sizes
    labels = {
        "small": f"non-streaming, {sizes['small']} body",
        "large": f"non-streaming, {sizes['large']} body",
        "ttfb": f"streaming, time to first byte, {sizes['small']} body",
        "agent": "growing conversation (agent loop, ~10→20 KiB)",
    }
    columns = ["scenario", *names, "kvwarm / direct", "kvwarm added ÷ bare added", f"aim ≤{ADDED_AIM:g}x"]
    columns += [f"{o} added ÷ bare added" for o in others]
    table = Table("Latency, client-side (in parentheses: added vs direct, ms)", columns)
    misses: list[str] = []
    for scenario, per_target in results.latency.items():
        for q, qname in ((0.5, "p50"), (0.99, "p99")):
            stat = {n: percentile(per_target[n], q) for n in names}
            direct = stat["direct"]
            added = {n: stat[n] - direct for n in proxies}
            text, aim, ok = _added_ratio(added["kvwarm"], added["bare"])
            if ok is False:
                misses.append(f"{labels[scenario]} {qname} ({text})")
            table.add(
                f"{labels[scenario]}, {qname}",
                *(_cell(stat[n], None if n == "direct" else direct) for n in names),
                x(ratio(stat["kvwarm"], direct)), text, aim,
                *(_added_ratio(added[o], added["bare"])[0] for o in others),
            )
    table.notes.append(
        f"Samples per target: {plan.small} (2 KB), {plan.large} (500 KB), {plan.stream} (stream), "
        f"{plan.agent_runs}×{plan.agent_turns} agent turns, after warm-up; targets interleaved in rotating order. "
        "Added latency = the target's percentile minus direct's; below 50 µs it is noise and no ratio is taken."
    )
    table.notes.append(
        f"kvwarm and the bare pass-through run on {loop_kind()}; the reference upstream on asyncio's "
        f"default loop; the client (this process) on {loop_kind()}. 2 CPUs shared by client, proxies and "
        "upstream (and whatever else runs on the machine): p99 is mostly scheduling noise."
    )
    agent = results.latency.get("agent")
    if agent:
        later = {n: [v for i, v in enumerate(agent[n]) if i % plan.agent_turns] for n in names}
        p99 = {n: percentile(later[n], 0.99) for n in names}
        table.notes.append(
            "Agent loop without each session's first turn (when kvwarm records, and counts the tokens of, "
            "the whole system prompt and tools): p99 "
            + ", ".join(f"{n} {ms(p99[n])}" for n in names)
            + "."
        )
    table.notes.append(
        "The reference upstream tokenizes every prompt with tiktoken (~0.2 s for the 500 KB body), "
        "so that row's added latency sits on a large, noisy base: read its ratio with care."
    )
    if peer_note:
        table.notes.append(peer_note)

    cpu = Table(
        "Proxy CPU time per request (user + system of the proxy process, all threads; immune to scheduling noise)",
        ["scenario", *[f"{n}" for n in proxies], "kvwarm / bare", *[f"{o} / bare" for o in others]],
    )
    for scenario, per_proxy in results.cpu.items():
        if "bare" not in per_proxy or "kvwarm" not in per_proxy:
            continue
        label = labels.get(scenario, scenario)
        cpu.add(
            label, *(ms(per_proxy[n]) if n in per_proxy else "n/a" for n in proxies),
            x(ratio(per_proxy["kvwarm"], per_proxy["bare"])),
            *(x(ratio(per_proxy[o], per_proxy["bare"])) if o in per_proxy else "n/a" for o in others),
        )
    cpu.notes.append("From /proc/PID/stat (10 ms ticks) over each whole scenario, warm-ups included, divided by its requests.")

    tcols = ["body", *[f"{n} req/s" for n in names], "kvwarm / direct", "kvwarm / bare", f"aim ≥{THROUGHPUT_AIM:g}x"]
    tcols += [f"{o} / bare" for o in others]
    tput = Table(
        f"Throughput, {CONCURRENCY} concurrent clients (median of {plan.rounds} rounds × {plan.round_seconds:g} s per target)",
        tcols,
    )
    for scenario, per_target in results.throughput.items():
        med = {n: median(per_target[n]) for n in names}
        r = ratio(med["kvwarm"], med["bare"])
        ok = r >= THROUGHPUT_AIM
        if not ok:
            misses.append(f"throughput with a {sizes[scenario]} body ({x(r)} of bare)")
        tput.add(
            sizes[scenario], *(f"{med[n]:.0f}" for n in names),
            x(ratio(med["kvwarm"], med["direct"])), x(r), mark(ok),
            *(x(ratio(med[o], med["bare"])) for o in others),
        )
    tput.notes.append(
        "The reference upstream renders and tokenizes every prompt: with 2 CPUs it is the bottleneck "
        "of the direct path, and every proxy competes with it and with the client for CPU."
    )
    findings: list[str] = []
    if misses:
        findings.append("kvwarm misses the aim on: " + "; ".join(misses) + ".")
    else:
        findings.append("kvwarm meets the aim everywhere it can be judged (added latency ≤1.2x bare, throughput ≥ bare).")
    cpu_ratios = [
        ratio(v["kvwarm"], v["bare"]) for v in results.cpu.values() if "kvwarm" in v and "bare" in v
    ]
    if cpu_ratios:
        findings.append(
            f"kvwarm's process uses {min(cpu_ratios):.1f}-{max(cpu_ratios):.1f}x the CPU per request of the "
            "bare pass-through (see the CPU table): that difference, not the network, is its overhead."
        )
    return Section("1. Proxy overhead (issue 2)", [table, cpu, tput], findings, seconds)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="proxy overhead only")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--peers", action="store_true")
    args = parser.parse_args()
    print(run(args.quick, args.peers).markdown())


if __name__ == "__main__":
    main()
