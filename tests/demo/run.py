"""``make demo``: drifting agents, direct vs through kvwarm, on the reference upstream; then kvwarm stays up.

    python -m tests.demo.run [--duration 30] [--cache openai|vllm] [--port 8080] [--no-wait]

What runs (all on 127.0.0.1, as subprocesses of this script):

- two reference upstreams (``kvwarm upstream-sim``): one the agents talk to
  directly, one behind kvwarm, so the two prefix caches never mix;
- kvwarm (``kvwarm serve --store memory``) on port 8080, or on a free port
  when 8080 is taken (said so on the console);
- one agent per safe drift class of :data:`tests.agents.SAFE_DRIFTS`, a
  never-drifting baseline, and a *semantic control* whose system prompt starts
  with the current time (a real change kvwarm must not rewrite); each runs twice
  at once, direct and through kvwarm, with the official ``openai`` SDK
  (``AsyncOpenAI``). Agents differ by system prompt and API key, so their
  prefixes never mix either. Conversations restart with a new task every few
  turns until the time is up.

Then a table per agent: cache-hit % direct vs through kvwarm, repairs, prompt
tokens rescued (from the ``x-kvwarm-prefix`` response header) and prefix breaks
by reason, followed by kvwarm's own totals from ``/metrics``. kvwarm and its
upstream keep running, ``/metrics`` populated, until Ctrl-C (``--no-wait``: exit
at the end, for CI). Start ``make dashboard`` first to watch it live.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.agents import SAFE_DRIFTS, SYSTEM, USER_TURNS, Agent, Drift, Post, Turn, no_drift

ROOT = Path(__file__).resolve().parents[2]
PREFERRED_PORT = 8080
LOGS = ROOT / "var" / "demo"
"""The servers' logs."""
TURNS_PER_SESSION = 6
"""A conversation restarts (a new session, same system prompt) after this many turns."""
TTFT_PER_TOKEN = 0.0001
"""Seconds of upstream time to first token per uncached prompt token: cache hits answer sooner."""
THINK = (0.3, 0.9)
"""Seconds an agent 'thinks' between two turns (uniform), so the run spreads over the scrapes."""
FAULTS = 2
"""Requests sent through kvwarm with an injected upstream 503, so the dashboard's error panels have data."""
SEMANTIC = "semantic: timestamp"
BASELINE = "baseline: no drift"

TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z")


def now_stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def timestamp_in_system(msgs: list[dict[str, Any]], tools: list[dict[str, Any]], turn: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Semantic control: the system prompt carries the current time, re-rendered every turn.

    A real change of meaning: kvwarm must forward it as sent and report a
    ``system_changed`` break (``repair.pin_patterns`` is the opt-in that pins it).
    """
    for m in msgs:
        if m.get("role") == "system" and isinstance(m.get("content"), str):
            m["content"] = TIMESTAMP.sub(now_stamp(), m["content"])
    return msgs, tools


def agent_system(name: str) -> str:
    """A system prompt of its own per agent (so agents never share a cached prefix)."""
    head = f"Agent profile: {name}.\n"
    if name == SEMANTIC:
        head = f"Current time: {now_stamp()}\n" + head
    return head + SYSTEM


def new_agent(post: Post, name: str, drift: Drift, session: int = 1) -> Agent:
    """Session ``session`` of an agent: its system prompt and tools, and a task of its own.

    The task differs per session because the drift functions depend on the turn number only:
    a session repeating an earlier one's task would replay its prompts and hit the provider's
    cache by coincidence.
    """
    system = agent_system(name)
    task = f"Task {session}: {USER_TURNS[0]}"
    return Agent(post, drift=drift, system=system,
                 history=[{"role": "system", "content": system}, {"role": "user", "content": task}])


def scenarios() -> dict[str, Drift]:
    """The agents of the demo: a baseline, every safe drift class, and the semantic control."""
    return {BASELINE: no_drift, **SAFE_DRIFTS, SEMANTIC: timestamp_in_system}


def api_key(name: str) -> str:
    return "sk-demo-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def sdk_post(client: openai.AsyncOpenAI, **create_kwargs: Any) -> Post:
    """An :class:`~tests.agents.Agent` ``post``: one chat completion with the openai SDK.

    Returns the response body as a dict, plus ``_headers`` (lower-case names) for kvwarm's
    ``x-kvwarm-prefix``.
    """

    async def post(body: dict[str, Any]) -> dict[str, Any]:
        raw = await client.chat.completions.with_raw_response.create(**body, **create_kwargs)
        data: dict[str, Any] = raw.parse().model_dump()
        data["_headers"] = {k.lower(): v for k, v in raw.headers.items()}
        return data

    return post


def prefix_header(turn: Turn) -> dict[str, str]:
    """``x-kvwarm-prefix: matched=3/5; repaired=1; rescued=2048; break=...`` as a dict ({} when absent)."""
    value = turn.response.get("_headers", {}).get("x-kvwarm-prefix", "")
    return dict(p.strip().split("=", 1) for p in value.split(";") if "=" in p)


@dataclass
class Tally:
    """What one agent saw over all its conversations on one path (direct or through kvwarm)."""

    turns: int = 0
    prompt: int = 0
    cached: int = 0
    repaired: int = 0
    rescued: int = 0
    breaks: Counter[str] = field(default_factory=Counter)

    def add(self, turn: Turn) -> None:
        self.turns += 1
        self.prompt += turn.prompt
        self.cached += turn.cached
        header = prefix_header(turn)
        self.repaired += int(header.get("repaired", 0))
        self.rescued += int(header.get("rescued", 0))
        if "break" in header:
            self.breaks[header["break"].split("@")[0]] += 1

    @property
    def hit(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0


async def run_pair(direct: Post, via: Post, name: str, drift: Drift, deadline: float,
                   tallies: tuple[Tally, Tally], rng: random.Random) -> None:
    """One scenario in lock-step on both paths: conversations of :data:`TURNS_PER_SESSION` turns until ``deadline``.

    Both agents take each turn at the same moment, so their sessions and turn
    counts match and the two hit percentages compare like with like.
    """
    session = 0
    while time.monotonic() < deadline:
        session += 1
        agents = [new_agent(post, name, drift, session) for post in (direct, via)]
        for _ in range(TURNS_PER_SESSION):
            if time.monotonic() >= deadline:
                return
            turns = await asyncio.gather(*(a.step() for a in agents))
            for tally, turn in zip(tallies, turns, strict=True):
                tally.add(turn)
            await asyncio.sleep(rng.uniform(*THINK))


async def inject_faults(client: openai.AsyncOpenAI, count: int, deadline: float) -> int:
    """Requests whose upstream answers 503 (x-sim-fault), spread over the run; returns how many failed."""
    failed = 0
    for i in range(count):
        await asyncio.sleep(max(0.0, (deadline - time.monotonic()) / (count - i + 1)))
        try:
            await client.chat.completions.create(
                model="kvwarm-sim", messages=[{"role": "user", "content": "ping"}],
                extra_headers={"x-sim-fault": "status=503"},
            )
        except openai.APIStatusError:
            failed += 1
    return failed


async def run_workload(direct_url: str, kvwarm_url: str, duration: float) -> tuple[dict[str, tuple[Tally, Tally]], int]:
    """Every scenario, direct and through kvwarm at once, for ``duration`` seconds."""
    tallies = {name: (Tally(), Tally()) for name in scenarios()}
    deadline = time.monotonic() + duration
    clients: list[openai.AsyncOpenAI] = []

    def client(url: str, name: str) -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(base_url=url, api_key=api_key(name), max_retries=0, timeout=60)
        clients.append(c)
        return c

    try:
        tasks = [
            run_pair(sdk_post(client(direct_url, name)), sdk_post(client(kvwarm_url, name)), name, drift,
                     deadline, tallies[name], random.Random(i))
            for i, (name, drift) in enumerate(scenarios().items())
        ]
        faults = asyncio.ensure_future(inject_faults(client(kvwarm_url, "faults"), FAULTS, deadline))
        await asyncio.gather(*tasks)
        failed = await faults
    finally:
        for c in clients:
            await c.close()
    return tallies, failed


# -- reporting ---------------------------------------------------------------------------------------

def table(tallies: dict[str, tuple[Tally, Tally]]) -> str:
    head = ("agent", "turns", "hit % direct", "hit % kvwarm", "repaired", "tokens rescued", "breaks through kvwarm")
    rows = [head]
    total_d, total_k = Tally(), Tally()
    for name, (d, k) in tallies.items():
        breaks = ", ".join(f"{r} x{n}" for r, n in k.breaks.most_common()) or "-"
        rows.append((name, f"{k.turns}", f"{100 * d.hit:.1f}", f"{100 * k.hit:.1f}", f"{k.repaired}", f"{k.rescued}", breaks))
        for src, dst in ((d, total_d), (k, total_k)):
            dst.turns += src.turns
            dst.prompt += src.prompt
            dst.cached += src.cached
            dst.repaired += src.repaired
            dst.rescued += src.rescued
            dst.breaks.update(src.breaks)
    rows.append(("all agents", f"{total_k.turns}", f"{100 * total_d.hit:.1f}", f"{100 * total_k.hit:.1f}",
                 f"{total_k.repaired}", f"{total_k.rescued}",
                 ", ".join(f"{r} x{n}" for r, n in total_k.breaks.most_common()) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for n, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:-1], strict=True)] + [r[-1]]
        lines.append("  ".join(cells).rstrip())
        if n in (0, len(rows) - 2):
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def metrics_summary(text: str) -> str:
    """kvwarm's own totals from its /metrics exposition."""
    label_of = {"kvwarm_repairs_total": "kind", "kvwarm_prefix_breaks_total": "reason",
                "kvwarm_cost_usd_total": "source", "kvwarm_requests_total": "status"}
    sums: defaultdict[str, float] = defaultdict(float)
    by: dict[str, defaultdict[str, float]] = {name: defaultdict(float) for name in label_of}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            sums[s.name] += s.value
            if s.name in by:
                by[s.name][s.labels[label_of[s.name]]] += s.value

    def listing(name: str, fmt: str = "{:.0f}") -> str:
        ranked = sorted(by[name].items(), key=lambda kv: -kv[1])
        return ", ".join(f"{k} {fmt.format(v)}" for k, v in ranked) or "-"

    known = sums["kvwarm_cache_known_prompt_tokens_total"]
    hit = 100 * sums["kvwarm_cached_prompt_tokens_total"] / known if known else 0.0
    return "\n".join([
        f"  requests            {listing('kvwarm_requests_total')}",
        f"  cache hit           {hit:.1f} % ({sums['kvwarm_cached_prompt_tokens_total']:.0f} of "
        f"{known:.0f} prompt tokens cached)",
        f"  tokens rescued      {sums['kvwarm_repair_rescued_tokens_total']:.0f}",
        f"  repairs by kind     {listing('kvwarm_repairs_total')}",
        f"  breaks by reason    {listing('kvwarm_prefix_breaks_total')}",
        f"  cost                {listing('kvwarm_cost_usd_total', '${:.4f}')}",
    ])


# -- processes -------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_ready(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode} before it was ready (logs: {LOGS})")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise SystemExit(f"{what} did not become ready at {url} within {timeout:.0f} s")


@contextlib.contextmanager
def servers(port: int, cache: str) -> Iterator[tuple[str, str, str]]:
    """Start the two upstreams and kvwarm; yield (direct upstream URL, kvwarm URL, kvwarm address)."""
    procs: list[subprocess.Popen[bytes]] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWARM_")}

    LOGS.mkdir(parents=True, exist_ok=True)

    def start(log: str, *args: str) -> subprocess.Popen[bytes]:
        with (LOGS / log).open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "proxy", *args], cwd=ROOT, env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc

    try:
        direct_port, behind_port = free_port(), free_port()
        sims = []
        for p in (direct_port, behind_port):
            sims.append((p, start(f"upstream-{p}.log", "upstream-sim", "--port", str(p), "--cache", cache,
                                  "--ttft-per-token", str(TTFT_PER_TOKEN))))
        kv = start("kvwarm.log", "serve", "--host", "127.0.0.1", "--port", str(port), "--store", "memory",
                   "--upstream", f"http://127.0.0.1:{behind_port}/v1", "--log-level", "WARNING")
        for p, proc in sims:
            wait_ready(f"http://127.0.0.1:{p}/v1/models", proc, "the reference upstream")
        wait_ready(f"http://127.0.0.1:{port}/readyz", kv, "kvwarm")
        yield f"http://127.0.0.1:{direct_port}/v1", f"http://127.0.0.1:{port}/v1", f"127.0.0.1:{port}"
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for_ctrl_c() -> None:
    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stop:
        time.sleep(0.3)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=30.0, metavar="S", help="seconds of agent traffic (default 30)")
    parser.add_argument("--cache", choices=("openai", "vllm"), default="openai",
                        help="the upstreams' prefix-cache mode (default openai: prompts only; vllm also caches replies)")
    parser.add_argument("--port", type=int, default=PREFERRED_PORT, help="kvwarm's port when free (default 8080)")
    parser.add_argument("--no-wait", action="store_true", help="exit after the table instead of keeping kvwarm up")
    args = parser.parse_args(argv)

    port = args.port
    if not port_free(port):
        port = free_port()
        print(f"Port {args.port} is taken: kvwarm listens on 127.0.0.1:{port} instead.")
    with servers(port, args.cache) as (direct_url, kvwarm_url, address):
        n = len(scenarios())
        print(f"kvwarm      {kvwarm_url}  (metrics: http://{address}/metrics)")
        print(f"upstreams   {direct_url} (direct), another one behind kvwarm; {args.cache} cache mode")
        print(f"agents      {n} scenarios x 2 (direct, through kvwarm), openai SDK, {args.duration:.0f} s ...")
        tallies, failed = asyncio.run(run_workload(direct_url, kvwarm_url, args.duration))
        print()
        print(table(tallies))
        print()
        print("hit %: cached / prompt tokens the upstream reported; repaired, tokens rescued, breaks: kvwarm's")
        print("x-kvwarm-prefix header per response. The semantic control's timestamp is a real change: kvwarm")
        print("forwards it as sent and names the break (repair.pin_patterns is the opt-in that pins it).")
        print("The upstream's replies depend on the prompt it gets, so a drifting conversation and its repaired")
        print("twin can diverge a little: differences under a point are noise (tests/proxy/test_drift.py checks")
        print("turn by turn that kvwarm gives a drifting agent exactly a non-drifting agent's cache hits).")
        print(f"{failed} request(s) got an injected upstream 503 (x-sim-fault), for the dashboard's error panels.")
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            exposition = r.read().decode()
        print()
        print(f"kvwarm's own counters (http://{address}/metrics):")
        print(metrics_summary(exposition))
        if args.no_wait:
            return 0
        print()
        hint = "make dashboard" if address == f"127.0.0.1:{PREFERRED_PORT}" else f"KVWARM_ADDR={address} make dashboard"
        print(f"kvwarm stays up at {kvwarm_url} with its upstream, /metrics populated. In another terminal:")
        print(f"  {hint}     # Prometheus (+ Grafana when installed) on these metrics")
        print(f"  OPENAI_BASE_URL={kvwarm_url} <your agent>   # more traffic")
        print("Ctrl-C stops everything.")
        wait_for_ctrl_c()
        print("\nstopping")
    return 0


if __name__ == "__main__":
    sys.exit(main())
