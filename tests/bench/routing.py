"""Routing over a pool of replicas: cached tokens under ``prefix``, ``round_robin``, ``least_inflight``.

``python -m tests.bench.routing [--sessions 32] [--prompts 8] [--turns 10] [--replicas 4]``
(also the ``routing`` section of ``python -m tests.bench.run``).

Four reference upstreams in vLLM cache mode (16-token blocks, generated tokens kept)
are the replicas, each with a KV capacity for a quarter of all sessions' prefixes (each
session's last prompt and reply, its system prompt included). Agent
sessions (tests/agents.py) run concurrently through one kvwarm, spread over a few system
prompts, half of them drifting (each re-serializes its history its own way), their tool
results carrying pages of session-specific files so that histories grow as real agents'
do. Every
policy runs the same workload on fresh replicas; the ideal is one replica with an
unbounded cache (every prefix that was ever computed is still there).

Reported per policy: cached prompt tokens and their share of the ideal, and requests per
replica (max / mean). Everything runs in this process on loopback sockets: kvwarm and the
replicas are the real apps (``create_app``, ``create_sim_app``); the numbers are token
counts, not timings, so they do not depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.appkeys import REGISTRY
from proxy.config import load_settings
from proxy.routing import DECISIONS
from proxy.sim.server import REPLY_TOKENS_HEADER, SIM_STATE, SimConfig, create_sim_app
from tests.agents import SAFE_DRIFTS, SYSTEM, USER_TURNS, Agent, no_drift
from tests.bench.report import Section, Table

POLICIES = ("prefix", "round_robin", "least_inflight")
TOOL_OUTPUT_LINES = 30
"""Lines of (session-specific) file content in each tool result: agent histories grow."""
REPLY_TOKENS = 120
DRIFTS = [d for name, d in SAFE_DRIFTS.items() if name != "varying"] + [SAFE_DRIFTS["varying"]]


@dataclass(frozen=True)
class Workload:
    sessions: int = 32
    prompts: int = 8
    turns: int = 10
    replicas: int = 4
    ttft_base: float = 0.01
    """Seconds each replica takes before the first token (keeps requests in flight together)."""
    ttft_per_uncached_token: float = 2e-6
    tool_output_lines: int = TOOL_OUTPUT_LINES


@dataclass
class Result:
    policy: str
    cached: int = 0
    prompt: int = 0
    per_replica: list[int] = field(default_factory=list)
    prefixes: int = 0
    """Sum over the sessions of their last prompt plus reply (tokens): all sessions' prefixes."""
    decisions: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    per_session: list[int] = field(default_factory=list)
    """Cached prompt tokens of each session (session ``i`` is the same agent under every policy)."""

    def worst_session(self, ideal: Result) -> float:
        """The lowest share of a session's cached tokens under ``ideal`` that it kept here."""
        shares = [mine / best for mine, best in zip(self.per_session, ideal.per_session, strict=True) if best]
        return min(shares, default=1.0)

    @property
    def spread(self) -> float:
        """max / mean requests per replica."""
        mean = statistics.fmean(self.per_replica) if self.per_replica else 0.0
        return max(self.per_replica) / mean if mean else 0.0


def system_prompt(k: int) -> str:
    """System prompt ``k``: differs from the others from its first line (a different project)."""
    return f"Project {k}: " + SYSTEM


def make_agent(i: int, workload: Workload, post: Any) -> Agent:
    """Session ``i``: system prompt ``i % prompts``, its own first message, every other one drifting."""
    drift = DRIFTS[(i // 2) % len(DRIFTS)] if i % 2 else no_drift
    turns = [f"Session {i}: {USER_TURNS[0]}", *USER_TURNS[1:]]
    return Agent(post, drift=drift, system=system_prompt(i % workload.prompts), user_turns=turns)


async def run_agent(agent: Agent, i: int, workload: Workload) -> None:
    """``turns`` steps; each tool result carries a page of this session's files (histories grow
    as real agents' do: the shared system prompt is not most of the KV)."""
    for turn in range(workload.turns):
        known = len(agent.history)
        await agent.step()
        for message in agent.history[known:]:
            if message["role"] == "tool":
                message["content"] += "".join(
                    f"src/s{i}/mod_{turn}.py:{n}: value_{i}_{turn}_{n} = compute({n * 7 + i}, key='k{turn}')\n"
                    for n in range(workload.tool_output_lines)
                )


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` on a free loopback port while the block runs; yields ``http://127.0.0.1:P``."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def replicas(n: int, config: SimConfig) -> AsyncIterator[list[tuple[str, web.Application]]]:
    """``n`` reference upstreams: (base URL, app) each."""
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for _ in range(n):
            app = create_sim_app(config)
            url = await stack.enter_async_context(serving(app))
            out.append((url + "/v1", app))
        yield out


@contextlib.asynccontextmanager
async def kvwarm(upstreams: Sequence[str], **overrides: Any) -> AsyncIterator[tuple[str, web.Application]]:
    settings = load_settings(
        None,
        env={},
        overrides={"store.backend": "memory", "upstream.base_url": list(upstreams), "log.level": "WARNING", **overrides},
    )
    app = create_app(settings, registry=CollectorRegistry())
    async with serving(app) as url:
        yield url, app


def chat_poster(session: aiohttp.ClientSession, url: str, key: str) -> Any:
    async def post(body: dict[str, Any]) -> dict[str, Any]:
        async with session.post(
            f"{url}/v1/chat/completions",
            data=orjson.dumps(body),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json", REPLY_TOKENS_HEADER: str(REPLY_TOKENS)},
        ) as r:
            if r.status != 200:
                raise AssertionError(f"HTTP {r.status}: {await r.text()}")
            data: dict[str, Any] = await r.json(loads=orjson.loads)
            return data

    return post


async def run_policy(policy: str, workload: Workload, capacity_tokens: int | None) -> Result:
    """The workload through kvwarm over fresh replicas (``ideal``: one replica, unbounded)."""
    started = time.perf_counter()
    n = 1 if policy == "ideal" else workload.replicas
    config = SimConfig(
        cache_mode="vllm",
        kv_capacity_tokens=capacity_tokens,
        ttft_base=workload.ttft_base,
        ttft_per_uncached_token=workload.ttft_per_uncached_token,
    )
    result = Result(policy)
    async with replicas(n, config) as pool, kvwarm([u for u, _ in pool], **{"routing.policy": "prefix" if policy == "ideal" else policy}) as (url, app):
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            post = chat_poster(session, url, "sk-bench-routing")
            agents = [make_agent(i, workload, post) for i in range(workload.sessions)]
            await asyncio.gather(*(run_agent(a, i, workload) for i, a in enumerate(agents)))
        for agent in agents:
            result.per_session.append(sum(turn.cached for turn in agent.turns))
            for turn in agent.turns:
                result.cached += turn.cached
                result.prompt += turn.prompt
            last = agent.turns[-1].usage
            result.prefixes += int(last.get("prompt_tokens", 0)) + int(last.get("completion_tokens", 0))
        for _, sim in pool:
            result.per_replica.append(len(sim[SIM_STATE].requests))
        for kind in DECISIONS:
            value = app[REGISTRY].get_sample_value("kvwarm_routing_decisions_total", {"kind": kind})
            if value:
                result.decisions[kind] = value
    result.seconds = time.perf_counter() - started
    return result


async def compare(workload: Workload, policies: Sequence[str] = POLICIES) -> tuple[Result, dict[str, Result], int]:
    """The ideal, then each policy with per-replica KV for a quarter of all sessions' prefixes."""
    ideal = await run_policy("ideal", workload, None)
    capacity = ideal.prefixes // workload.replicas
    results = {p: await run_policy(p, workload, capacity) for p in policies}
    return ideal, results, capacity


def section(workload: Workload, ideal: Result, results: dict[str, Result], capacity: int, seconds: float) -> Section:
    table = Table(
        f"{workload.sessions} concurrent agent sessions over {workload.prompts} system prompts, {workload.turns} turns, "
        f"{workload.replicas} replicas",
        [
            "policy", "cached prompt tokens", "share of ideal", "worst session's share", "requests per replica",
            "max / mean", "decisions",
        ],
    )
    table.add("ideal (one unbounded replica)", f"{ideal.cached:,}", "1.000", "1.000", str(ideal.per_replica[0]), "—", "")
    for policy, r in results.items():
        decisions = ", ".join(f"{k} {int(v)}" for k, v in sorted(r.decisions.items()))
        table.add(
            f"`{policy}`", f"{r.cached:,}", f"{r.cached / ideal.cached:.3f}", f"{r.worst_session(ideal):.3f}",
            " / ".join(str(n) for n in r.per_replica), f"{r.spread:.2f}", decisions,
        )
    table.notes = [
        f"Replicas: the reference upstream in vLLM cache mode, KV capacity {capacity:,} tokens each, LRU: "
        f"a quarter of all sessions' prefixes ({ideal.prefixes:,} tokens: each session's last prompt and reply, "
        "the shared system prompt counted in each). Worst session's share: the lowest of any session's "
        "cached tokens over its own under the ideal (a session moved to another replica prefills its history again).",
        "Half of the sessions drift (re-serialized history, reordered tools, content as parts, ...): "
        "kvwarm repairs them, and `prefix` routes them by the repaired identity.",
        f"Prompt tokens in all: {ideal.prompt:,} per run (the same requests under every policy). The ideal also "
        "serves each session's first turn from the system prompt its siblings cached; on a pool, only siblings "
        "on the same replica can.",
    ]
    prefix = results.get("prefix")
    findings = []
    if prefix is not None:
        findings.append(
            f"`prefix` keeps {prefix.cached / ideal.cached:.1%} of the ideal's cached tokens with max/mean "
            f"{prefix.spread:.2f} requests per replica."
        )
        others = [p for p in results if p != "prefix"]
        if others:
            findings.append(
                "; ".join(f"`{p}` {results[p].cached / ideal.cached:.1%}" for p in others)
                + ": each replica sees every session, and a quarter of the KV cannot hold them all."
            )
    return Section("Routing over a pool of replicas", [table], findings, seconds)


def run(quick: bool = False) -> Section:
    """The ``routing`` section of ``python -m tests.bench.run``."""
    workload = Workload(turns=6) if quick else Workload()
    started = time.perf_counter()
    ideal, results, capacity = asyncio.run(compare(workload))
    return section(workload, ideal, results, capacity, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.routing", description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=Workload.sessions)
    parser.add_argument("--prompts", type=int, default=Workload.prompts)
    parser.add_argument("--turns", type=int, default=Workload.turns)
    parser.add_argument("--replicas", type=int, default=Workload.replicas)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    workload = Workload(sessions=args.sessions, prompts=args.prompts, turns=args.turns, replicas=args.replicas)
    started = time.perf_counter()
    ideal, results, capacity = asyncio.run(compare(workload))
    print(section(workload, ideal, results, capacity, time.perf_counter() - started).markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
