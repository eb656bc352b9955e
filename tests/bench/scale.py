"""Scaling out (issue 12): what the shared Redis store adds per request, and ``--workers 2`` vs 1.

``python -m tests.bench.scale [--quick]`` (needs ``redis-server``: .ci/install/redis.sh)

Two parts:

- **Redis store vs memory store**: :func:`tests.bench.redis_store.section`, one request of a
  20-message session from view to ``write_turn``, in-process, on loopback.
- **Throughput, 32 concurrent clients**: processes on loopback: ``redis-server``, the reference
  upstream (``python -m proxy upstream-sim``, OpenAI cache mode, no delays), two kvwarm on
  the same Redis (``python -m proxy serve --store redis://...``): ``--workers 1`` and
  ``--workers 2``, and the bare aiohttp pass-through of the proxy benchmark
  (``tests/bench/passthrough.py``) as the baseline. This process is the client (aiohttp,
  keep-alive, one session per target, on uvloop when installed); the targets are measured in
  rotating order within each round, the upstream alone ("direct") alongside as the ceiling.
  Besides requests/s, the CPU time each proxy's processes (kvwarm's supervisor and workers)
  spend per request is read from ``/proc``, and each worker's share of the requests from its
  live page.

On a 2-CPU machine the client, the upstream, Redis and kvwarm's workers share the two cores:
a second worker can only win the CPU kvwarm itself was short of. The figures are reported
as measured.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from tests.bench import redis_store
from tests.bench.conversations import chat_body, conversation, small_body
from tests.bench.measure import median, ratio, rotated
from tests.bench.report import Section, Table, ms, x
from tests.bench.servers import REPO, Servers, python_module
from tests.store.redis_server import RedisServer, binaries_missing

CONCURRENCY = 32
PAGE = "/kvwarm/api/overview"
BARE = "bare pass-through"


@dataclass(frozen=True)
class Plan:
    redis_samples: int = 300
    rounds: int = 5
    round_seconds: float = 3.0

    @classmethod
    def quick(cls) -> Plan:
        return cls(redis_samples=100, rounds=3, round_seconds=1.5)


@dataclass
class Target:
    name: str
    base: str
    """``http://127.0.0.1:P`` (no ``/v1``)."""
    pid: int | None
    """kvwarm's supervisor or single process (None: the upstream itself)."""
    session: aiohttp.ClientSession = field(repr=False)
    requests: int = 0


def process_tree_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) of ``pid`` and its children; None when /proc cannot tell."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids = [pid, *(int(p) for p in f.read().split())]
        spent = 0.0
        for p in pids:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            spent += (int(fields[11]) + int(fields[12])) / tick
    except (OSError, ValueError, IndexError):
        return None
    return spent


async def throughput(target: Target, body: bytes, seconds: float, headers: dict[str, str]) -> float:
    """Requests/s completed by :data:`CONCURRENCY` clients sending ``body`` for ``seconds``."""
    loop = asyncio.get_running_loop()
    stop = loop.time() + seconds
    done = 0
    url = target.base + "/v1/chat/completions"

    async def client() -> None:
        nonlocal done
        while loop.time() < stop:
            target.requests += 1
            async with target.session.post(url, data=body, headers=headers) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{target.name} answered {resp.status}: {payload[:300]!r}")
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    return done / (time.perf_counter() - t0)


async def worker_shares(target: Target, workers: int, tries: int = 200) -> dict[int, float]:
    """Requests served by each worker since it started (its live page), on fresh connections."""
    seen: dict[int, float] = {}
    for _ in range(tries):
        async with aiohttp.ClientSession() as s, s.get(target.base + PAGE, headers={"Connection": "close"}) as r:
            page = orjson.loads(await r.read())
        seen[page["process"]["pid"]] = page["totals"]["requests"]
        if len(seen) == workers:
            break
    return seen


@dataclass
class Results:
    rps: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """body -> target -> requests/s per round."""
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)
    """body -> target -> the proxy's CPU seconds per request."""
    sizes: dict[str, str] = field(default_factory=dict)
    shares: dict[int, float] = field(default_factory=dict)


async def measure(bases: dict[str, tuple[str, int | None]], plan: Plan, log: Callable[[str], None]) -> Results:
    results = Results()
    targets = [
        Target(name, base, pid, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONCURRENCY * 2)))
        for name, (base, pid) in bases.items()
    ]
    bodies = {
        "~2 KB": small_body(),
        # 20 messages, under 20 000 bytes (the reference upstream parses it on its loop).
        "~9 KB, 20 messages": orjson.dumps(chat_body(conversation(20, 9_000, seed=3))),
    }
    results.sizes = {name: f"{len(body) / 1024:.1f} KiB" for name, body in bodies.items()}
    try:
        for name, body in bodies.items():
            log(f"throughput, {name}, concurrency {CONCURRENCY}")
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer sk-scale-{len(body)}"}
            for target in targets:
                await throughput(target, body, 0.5, headers)  # connections, caches, the stored prefix
            start = {t.name: (process_tree_cpu(t.pid) if t.pid else None, t.requests) for t in targets}
            rps: dict[str, list[float]] = {t.name: [] for t in targets}
            for i in range(plan.rounds):
                for target in rotated(targets, i):
                    rps[target.name].append(await throughput(target, body, plan.round_seconds, headers))
            results.rps[name] = rps
            results.cpu[name] = {}
            for t in targets:
                cpu0, n0 = start[t.name]
                cpu1 = process_tree_cpu(t.pid) if t.pid else None
                if cpu0 is not None and cpu1 is not None and t.requests > n0:
                    results.cpu[name][t.name] = (cpu1 - cpu0) / (t.requests - n0)
        two = next(t for t in targets if t.name == "kvwarm, 2 workers")
        results.shares = await worker_shares(two, 2)
    finally:
        for target in targets:
            await target.session.close()
    return results


def _run_client(bases: dict[str, tuple[str, int | None]], plan: Plan, log: Callable[[str], None]) -> Results:
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(measure(bases, plan, log))


def _wait_workers(base: str, workers: int, timeout: float = 60.0) -> None:
    """Until ``workers`` distinct workers have answered the live page."""

    async def wait() -> None:
        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while len(seen) < workers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only workers {sorted(seen)} answered at {base}")
            async with aiohttp.ClientSession() as s, s.get(base + PAGE, headers={"Connection": "close"}) as r:
                if r.status == 200:
                    seen.add(orjson.loads(await r.read())["process"]["pid"])

    asyncio.run(wait())


def throughput_table(results: Results, plan: Plan) -> Table:
    names = list(next(iter(results.rps.values())))
    table = Table(
        f"Throughput, {CONCURRENCY} concurrent clients (keep-alive), Redis store: requests/s, median of"
        f" {plan.rounds} rounds of {plan.round_seconds:g} s",
        ["target", *(f"{body} ({size})" for body, size in results.sizes.items()),
         *(f"vs 1 worker, {body}" for body in results.sizes),
         *(f"vs {BARE}, {body}" for body in results.sizes),
         *(f"proxy CPU / request, {body}" for body in results.sizes),
         *(f"CPU ÷ {BARE}'s, {body}" for body in results.sizes)],
    )
    for name in names:
        kvwarm = name.startswith("kvwarm")
        rps = {body: median(results.rps[body][name]) for body in results.sizes}
        cells = [f"{rps[body]:.0f}" for body in results.sizes]
        vs = [x(ratio(rps[body], median(results.rps[body]["kvwarm, 1 worker"]))) if kvwarm else "" for body in results.sizes]
        vs_bare = [x(ratio(rps[body], median(results.rps[body][BARE]))) if kvwarm else "" for body in results.sizes]
        cpu = [ms(results.cpu[body][name]) if name in results.cpu[body] else "" for body in results.sizes]
        cpu_bare = [
            x(ratio(results.cpu[body][name], results.cpu[body][BARE]))
            if kvwarm and name in results.cpu[body] and BARE in results.cpu[body] else ""
            for body in results.sizes
        ]
        table.add(name, *cells, *vs, *vs_bare, *cpu, *cpu_bare)
    total = sum(results.shares.values()) or 1.0
    shares = " / ".join(f"{100 * n / total:.0f}%" for n in sorted(results.shares.values(), reverse=True))
    table.notes.extend(
        [
            f"loopback; {os.cpu_count()} CPUs shared by the client (this process), the reference upstream, redis-server"
            " and kvwarm: figures as measured, not what separate machines would give",
            "direct: the reference upstream alone (the ceiling of this machine); every kvwarm instance uses the same"
            " redis-server, one tenant per body (after the warm-up each request matches its whole stored prefix)",
            f"requests per worker of the 2-worker instance over the run (its live pages; SO_REUSEPORT hashes the"
            f" {CONCURRENCY} keep-alive connections): {shares}",
            f"{BARE}: the proxy benchmark's minimal aiohttp pass-through (tests/bench/passthrough.py), one process,"
            " forwarding to the same upstream; it keeps no store",
            "proxy CPU / request: user + system time of the proxy's processes (kvwarm: the supervisor and its"
            " workers), per request",
        ]
    )
    return table


def run(quick: bool = False) -> Section:
    why = binaries_missing()
    if why is not None:
        return Section("Scaling out: Redis store and workers", [], [f"skipped: {why}"], 0.0)
    started = time.perf_counter()
    plan = Plan.quick() if quick else Plan()
    log: Callable[[str], None] = lambda message: print(f"[bench] scale: {message}", file=sys.stderr, flush=True)  # noqa: E731

    log(f"redis store vs memory store ({plan.redis_samples} samples)")
    redis_part = redis_store.section(plan.redis_samples)

    env = {"KVWARM_LOG_LEVEL": "WARNING", "KVWARM_STORE_TIMEOUT": "1.0"}
    with tempfile.TemporaryDirectory() as tmp, Servers(REPO / "var" / "bench" / "scale") as group:
        redis = RedisServer(Path(tmp) / "redis").start()
        try:
            sim = group.start("upstream-sim", python_module("proxy", "upstream-sim", "--port", "{port}"), "/v1/models")
            bases: dict[str, tuple[str, int | None]] = {"direct": (f"http://127.0.0.1:{sim.port}", None)}
            bare = group.start(
                "bare", python_module("tests.bench.passthrough", "--port", "{port}", "--upstream", sim.base_url), "/v1/models"
            )
            bases[BARE] = (f"http://127.0.0.1:{bare.port}", bare.proc.pid)
            for workers in (1, 2):
                name = "kvwarm, 1 worker" if workers == 1 else f"kvwarm, {workers} workers"
                server = group.start(
                    f"kvwarm-workers-{workers}",
                    python_module(
                        "proxy", "serve", "--port", "{port}", "--workers", str(workers), "--store", redis.url,
                        "--upstream", sim.base_url,
                    ),
                    "/readyz",
                    env={**env, "KVWARM_STORE_REDIS_PREFIX": f"bench-scale-{workers}"},
                )
                base = f"http://127.0.0.1:{server.port}"
                _wait_workers(base, workers)
                bases[name] = (base, server.proc.pid)
            results = _run_client(bases, plan, log)
        finally:
            redis.stop()

    table = throughput_table(results, plan)
    findings = list(redis_part.findings)
    for body in results.sizes:
        one = median(results.rps[body]["kvwarm, 1 worker"])
        two = median(results.rps[body]["kvwarm, 2 workers"])
        bare_rps = median(results.rps[body][BARE])
        findings.append(
            f"{body}: 2 workers {two:.0f} req/s vs 1 worker {one:.0f} req/s ({x(ratio(two, one))}) on this machine;"
            f" against the {BARE} ({bare_rps:.0f} req/s), with the Redis store: 1 worker {x(ratio(one, bare_rps))},"
            f" 2 workers {x(ratio(two, bare_rps))}"
        )
    return Section(
        "Scaling out: Redis store and workers",
        [*redis_part.tables, table],
        findings,
        time.perf_counter() - started,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    print(run(args.quick).markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
