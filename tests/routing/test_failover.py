"""A replica killed mid-run (SIGKILL, requests in flight on it): no client sees a failure.

The replicas are ``kvwarm upstream-sim`` processes, so the one killed dies as a crashed
engine does: its connections reset, its port refuses. kvwarm runs in this process; agents
talk to it through the openai SDK (no retries of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tests.conftest import metric
from tests.demo.run import sdk_post
from tests.routing.conftest import SESSION, PooledFactory, router_of, session_agent

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def sim_processes(n: int) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """``n`` reference upstream processes: (base URL, process) each; all killed on exit."""
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        for _ in range(n):
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "proxy", "upstream-sim", "--port", str(port)],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            procs.append((f"http://127.0.0.1:{port}/v1", proc))
        deadline = time.monotonic() + START_TIMEOUT
        for url, proc in procs:
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            while True:
                assert proc.poll() is None, "the reference upstream exited"
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
                assert time.monotonic() < deadline, "the reference upstream did not start"
                time.sleep(0.05)
        yield procs
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


async def sessions_at(url: str) -> Counter[int]:
    """Session number -> requests the replica at ``url`` received (its ``/sim/requests``)."""
    async with aiohttp.ClientSession() as s, s.get(url.removesuffix("/v1") + "/sim/requests") as r:
        entries = await r.json(loads=orjson.loads)
    found = (SESSION.search(e["body"].encode()) for e in entries)
    return Counter(int(m.group(1)) for m in found if m)


def kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


async def test_replicas_killed_mid_run_fail_no_request(make_pooled: PooledFactory, openai_client: Any) -> None:
    """One replica crashes with requests in flight, another between two turns: every turn of
    every session is answered, and each session settles on a surviving replica."""
    with sim_processes(4) as procs:
        urls = [u for u, _ in procs]
        kvwarm = await make_pooled(urls, routing__max_load_factor=1000.0)  # failover alone moves sessions
        strict = openai_client(kvwarm)  # max_retries=0: any failure kvwarm lets through fails the test
        agents = [session_agent(i, sdk_post(strict), prompt=i) for i in range(12)]
        await asyncio.gather(*(a.run(2) for a in agents))
        seen = [await sessions_at(u) for u in urls]
        first = max(range(4), key=lambda k: len(seen[k]))
        assert seen[first], "the busiest replica serves someone"

        # Turn 3: each request held 0.6 s at its replica; the busiest replica is killed meanwhile.
        # What it had accepted died with it: kvwarm retries what it can prove unsent, and the
        # client's own retry (the SDK's default) of the rest finds it ejected or refusing.
        retrying = strict.with_options(max_retries=2)
        for agent in agents:
            agent.post = sdk_post(retrying, extra_headers={"x-sim-fault": "delay=0.6"})
        turn = asyncio.gather(*(a.step() for a in agents))
        await asyncio.sleep(0.3)
        kill(procs[first][1])
        await turn
        for agent in agents:
            agent.post = sdk_post(strict)
        await asyncio.gather(*(a.step() for a in agents))

        # Another crash, between turns: its pooled connections are dead, its port refuses.
        alive = [k for k in range(4) if k != first]
        seen = {k: await sessions_at(urls[k]) for k in alive}
        second = max(alive, key=lambda k: sum(seen[k].values()))
        kill(procs[second][1])
        survivors = [k for k in alive if k != second]
        before = {k: await sessions_at(urls[k]) for k in survivors}
        await asyncio.gather(*(a.run(2) for a in agents))
        after = {k: await sessions_at(urls[k]) for k in survivors}
        for i in range(12):
            grown = {k: after[k][i] - before[k][i] for k in survivors if after[k][i] > before[k][i]}
            assert list(grown.values()) == [2], (i, grown)  # turns 5 and 6: one surviving replica

        router = router_of(kvwarm)
        states = [d["state"] for d in router.describe()]
        assert [states[k] for k in (first, second)] == ["ejected", "ejected"]
        for k in (first, second):
            assert metric(kvwarm, "kvwarm_upstream_ejections_total", upstream=router.replicas[k].label) == 1
        assert metric(kvwarm, "kvwarm_routing_decisions_total", kind="failover") >= 1
        assert all(len(a.turns) == 6 for a in agents)

        # The live page lists the pool with both dead replicas ejected.
        async with aiohttp.ClientSession() as s, s.get(kvwarm.make_url("/kvwarm/api/overview")) as r:
            overview = await r.json()
        assert [u["state"] for u in overview["upstreams"]] == states
        assert overview["view"]["text"]["upstream"].startswith("4 replicas, 2 healthy")
        rows = overview["view"]["lists"]["upstreams"]
        assert [row["url"] for row in rows] == urls and rows[first]["state_tone"] == "bad"
        assert sum(int(row["requests"]) for row in rows) == sum(r.requests for r in router.replicas)
