"""Redis store: time a request adds against ``LocalStore(MemoryStore)``, on loopback.

``python -m tests.bench.redis_store [--samples N]`` (needs ``redis-server``: .ci/install/redis.sh)

One sample is the third request of an agent session, 20 messages long (~20 kB, tool calls
and results), timed from ``store.view()`` to the end of ``write_turn`` as the request path
does it: plan with the real planner, fill what the view missed (at most 3 rounds), plan
again, record the turn. Its two earlier turns are written, untimed, just before, in a
tenant of its own. Who wrote them:

- ``memory``: ``LocalStore(MemoryStore)`` (the baseline) wrote both;
- ``redis, one process``: the same RedisStore wrote both (its cache holds the prefix: the
  fill only asks Redis whether the new message exists);
- ``redis, alternating``: store A wrote turn 1, store B (another process' worth of
  clients on the same Redis) turn 2, A serves turn 3: B's nodes come from Redis;
- ``redis, cold process``: B wrote both, A never saw the session (a fresh replica).

Cases run interleaved (rotating order); wall time is measured, since Redis round trips
are what this is about. "added" = the case's percentile minus the baseline's. A bare
``PING`` round trip is measured alongside, for scale.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from proxy.core.match import tenant_root
from proxy.core.plan import plan_turn, turn_write
from proxy.core.policy import Policy
from proxy.core.record import Reply
from proxy.store.base import AsyncStore
from proxy.store.local import LocalStore
from proxy.store.memory.store import MemoryStore
from proxy.store.redis.store import RedisStore, RedisView
from tests.bench.conversations import chat_body, conversation
from tests.bench.measure import percentile, rotated
from tests.bench.report import Section, Table, us
from tests.store.redis_server import RedisServer, binaries_missing

POLICY = Policy()
SECRET = b"bench-secret-bench-secret-bench!"
HISTORY = 17
"""Messages of the scripted history; the timed request holds 20 (with two stored replies and
a new user message)."""


def _reply(text: str) -> Reply:
    return Reply(message={"role": "assistant", "content": text}, finish_reason="stop", partial=False, model="m")


async def request(store: AsyncStore, body: dict[str, Any], root: bytes, reply: Reply, now: float) -> int:
    """What the request path does with the store for one request; returns the fill rounds."""
    view = store.view(root) if isinstance(store, RedisStore) else store.view()
    plan = plan_turn(body, root, view, POLICY)
    if isinstance(view, RedisView) and plan.match is not None:
        view.want(plan.match.keys, plan.match.identities)
    rounds = 0
    while view.missing and rounds < 3:
        rounds += 1
        if await store.fill(view):  # False: every miss stayed absent, the plan stands
            plan = plan_turn(body, root, view, POLICY)
    write = turn_write(plan, reply, None, None, model="m", client_gone=False, now=now)
    assert write is not None
    await store.write_turn(write)
    return rounds


async def server_usec(client: Any) -> int:
    """Microseconds Redis spent in kvwarm's scripts so far (``INFO commandstats``; the commands a
    script calls are counted again under their own names, so only EVALSHA is summed)."""
    stats = await client.execute_command("INFO", "commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("usec", 0))


async def measure(url: str, samples: int) -> tuple[dict[str, dict[str, list[float]]], list[float]]:
    history = conversation(HISTORY, 20_000, seed=3)
    first_reply = _reply("I read the code; the fix is in store.py.")
    second_reply = _reply("Patched; running the tests next.")

    def bodies(i: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """Session ``i``'s three requests (its first user message names it)."""
        h = [*history]
        h[1] = {**h[1], "content": f"{h[1]['content']} (session {i})"}
        first = chat_body(h[:15])
        second = chat_body([*h[:15], first_reply.message, *h[15:17]])
        third = chat_body(
            [*h[:15], first_reply.message, *h[15:17], second_reply.message, {"role": "user", "content": "Good. Now run the tests."}]
        )
        assert len(third["messages"]) == 20
        return first, second, third

    memory = LocalStore(MemoryStore(3600, 1 << 40, SECRET))
    a = RedisStore(url, ttl_seconds=3600, secret=SECRET, timeout=1.0)
    b = RedisStore(url, ttl_seconds=3600, secret=SECRET, timeout=1.0)
    await a.open()
    await b.open()
    cases: dict[str, tuple[AsyncStore, AsyncStore, AsyncStore]] = {
        "memory": (memory, memory, memory),
        "redis, one process": (a, a, a),
        "redis, alternating": (a, b, a),
        "redis, cold process": (b, b, a),
    }
    out: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": [], "server": []} for name in cases}
    rounds: dict[str, set[int]] = {name: set() for name in cases}
    ping: list[float] = []
    names = list(cases)
    client = a._client
    assert client is not None
    try:
        for i in range(samples + 20):
            for name in rotated(names, i):
                w1, w2, reader = cases[name]
                root = tenant_root(SECRET, f"sk-{name}")  # one tenant per case, a session per sample
                first, second, third = bodies(i)
                await request(w1, first, root, first_reply, 1.0)
                await request(w2, second, root, second_reply, 2.0)
                before = await server_usec(client)
                t0, c0 = time.perf_counter(), time.thread_time()
                n = await request(reader, third, root, _reply("Tests pass."), 3.0)
                elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
                spent = (await server_usec(client) - before) / 1e6
                if i >= 20:  # warm-up: connections, scripts, code paths
                    out[name]["wall"].append(elapsed)
                    out[name]["cpu"].append(cpu)
                    out[name]["server"].append(spent)
                    rounds[name].add(n)
            t0 = time.perf_counter()
            await client.execute_command("PING")
            ping.append(time.perf_counter() - t0)
    finally:
        await a.close()
        await b.close()
    for name in names:
        assert rounds[name] <= {0, 1}, f"{name}: a continuing turn needs one fill, got {rounds[name]}"
    return out, ping


def section(samples: int = 300) -> Section:
    why = binaries_missing()
    if why is not None:
        raise SystemExit(why)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            results, ping = asyncio.run(measure(server.url, samples))
        finally:
            server.stop()
    base = results["memory"]
    wall = Table(
        f"One request of a 20-message session: view -> plan -> fill -> plan -> write_turn ({samples} samples)",
        ["case", "wall p50", "wall p99", "added wall p50", "client CPU p50", "added CPU p50", "Redis time p50"],
    )
    for name, r in results.items():
        wall.add(
            name,
            us(percentile(r["wall"], 0.5)),
            us(percentile(r["wall"], 0.99)),
            us(percentile(r["wall"], 0.5) - percentile(base["wall"], 0.5)),
            us(percentile(r["cpu"], 0.5)),
            us(percentile(r["cpu"], 0.5) - percentile(base["cpu"], 0.5)),
            us(percentile(r["server"], 0.5)) if name != "memory" else "",
        )
    wall.add("(a bare PING round trip)", us(percentile(ping, 0.5)), us(percentile(ping, 0.99)), "", "", "", "")
    wall.notes.extend(
        [
            "loopback, one redis-server (no persistence), redis-py asyncio + hiredis; every Redis case is"
            " 2 round trips (1 fill, 1 write_turn)",
            "client CPU: this thread's CPU time (time.thread_time), syscalls included; Redis time: what"
            " INFO commandstats charged for the request's two scripts",
            "wall time includes waiting for a CPU: on a shared, busy machine it measures the scheduler;"
            " CPU and Redis time do not",
        ]
    )
    added_cpu = percentile(results["redis, alternating"]["cpu"], 0.5) - percentile(base["cpu"], 0.5)
    server = percentile(results["redis, alternating"]["server"], 0.5)
    rtt = percentile(ping, 0.5)
    return Section(
        "Redis store",
        [wall],
        [
            f"replicas alternating: {us(added_cpu)} client CPU + {us(server)} Redis time + 2 round trips"
            f" (a bare PING: {us(rtt)} here) added per request",
        ],
        time.monotonic() - started,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.redis_store", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    print(section(args.samples).markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
