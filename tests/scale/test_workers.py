"""``kvwarm serve --workers 2`` as a user runs it: one port, two worker processes, one Redis.

Real processes on free loopback ports: ``redis-server``, the reference upstream
(``kvwarm upstream-sim``) and ``kvwarm serve --workers 2``; the official ``openai`` SDK as
client. Which worker answered is read from the live page (``/kvwarm/api/overview`` names its
pid and shows that worker's own counters); a request that follows the page on the same
keep-alive connection reaches the same worker. Nothing is added to responses for the tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.store.redis_server import HOST, RedisServer, free_port

REPO = Path(__file__).resolve().parents[2]
PAGE = "/kvwarm/api/overview"
SYSTEM = " ".join(f"Rule {i}: keep every prefix byte-stable so the provider cache stays warm." for i in range(120))
"""A system prompt of ~2000 tokens: the reference upstream (OpenAI mode) caches from 1024."""
STREAM_FAULT = {"x-sim-fault": "stall=0.3", "x-sim-reply-tokens": "24"}
"""A stream that lasts a few seconds: its first event at once, then one every 0.3 s."""


# -- processes -----------------------------------------------------------------------------------


@dataclass
class Kvwarm:
    """A running ``kvwarm serve --workers N`` (the supervisor's process) and its log."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


def children(pid: int) -> set[int]:
    """The live (not zombie) child processes of ``pid``."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(entry))
    return out


def environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


def existing(path: str) -> bool:
    return Path(path).exists()


def kvwarm_command(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "proxy", "serve", "--port", str(port), *args]


def start_kvwarm(log_dir: Path, redis_url: str, upstream: str, workers: int = 2, **env: str) -> Kvwarm:
    port = free_port()
    log = log_dir / f"kvwarm-{port}.log"
    full_env = {
        **os.environ,
        "KVWARM_STORE_REDIS_PREFIX": f"t{uuid.uuid4().hex[:10]}",  # this instance's own keys
        "KVWARM_STORE_TIMEOUT": "2.0",
        "KVWARM_LOG_LEVEL": "WARNING",
        "KVWARM_SERVER_SHUTDOWN_TIMEOUT": "10",
        **env,
    }
    return spawn(
        kvwarm_command(port, "--workers", str(workers), "--store", redis_url, "--upstream", upstream), port, log, full_env
    )


def spawn(command: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> Kvwarm:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    return Kvwarm(proc, port, log)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The reference upstream (``kvwarm upstream-sim``, OpenAI cache mode) in its own process."""
    port = free_port()
    log = tmp_path_factory.mktemp("sim") / "sim.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "upstream-sim", "--port", str(port)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection((HOST, port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the reference upstream did not start: {log.read_text()}") from None
                time.sleep(0.05)
        yield f"http://{HOST}:{port}/v1"
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def kvwarm(redis: RedisServer, upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kvwarm]:
    server = start_kvwarm(tmp_path_factory.mktemp("kvwarm"), redis.url, upstream)
    try:
        asyncio.run(pages(server))  # both workers serve
        yield server
    finally:
        stop(server.proc)


# -- reading the workers ---------------------------------------------------------------------------


async def page(session: aiohttp.ClientSession, kv: Kvwarm) -> dict[str, Any]:
    async with session.get(kv.url + PAGE) as r:
        assert r.status == 200, await r.text()
        data: dict[str, Any] = orjson.loads(await r.read())
        return data


async def scrape(session: aiohttp.ClientSession, kv: Kvwarm) -> dict[str, list[Any]]:
    """``/metrics``: family name -> its samples."""
    async with session.get(kv.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {f.name: list(f.samples) for f in text_string_to_metric_families(text)}


def total(families: dict[str, list[Any]], family: str, sample: str, **labels: str) -> float:
    return sum(
        s.value
        for s in families.get(family, [])
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


Visit = Callable[[aiohttp.ClientSession, dict[str, Any]], Awaitable[Any]]


async def each_worker(kv: Kvwarm, visit: Visit, *, want: int = 2, within: float = 20.0) -> dict[int, Any]:
    """Call ``visit(session, page)`` once per worker, on a connection pinned to that worker: each
    try opens a fresh connection (the kernel picks a worker for it), reads the page (its pid), and
    visits when the pid is new. Returns pid -> what ``visit`` returned."""
    out: dict[int, Any] = {}
    deadline = time.monotonic() + within
    while len(out) < want:
        assert time.monotonic() < deadline, f"saw workers {sorted(out)} only:\n{kv.log_tail()}"
        assert kv.proc.poll() is None, f"kvwarm exited {kv.proc.returncode}:\n{kv.log_tail()}"
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
                first = await page(session, kv)
                pid = first["process"]["pid"]
                if pid in out:
                    continue
                result = await visit(session, first)
                again = await page(session, kv)
                assert again["process"]["pid"] == pid, "the visit left the worker's connection"
                out[pid] = result
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.05)  # a worker restarting
    return out


async def pages(kv: Kvwarm) -> dict[int, dict[str, Any]]:
    async def keep(_: aiohttp.ClientSession, first: dict[str, Any]) -> dict[str, Any]:
        return first

    return await each_worker(kv, keep)


async def scrapes(kv: Kvwarm) -> dict[int, dict[str, list[Any]]]:
    """``/metrics`` as each worker answers it."""

    async def metrics(session: aiohttp.ClientSession, _: dict[str, Any]) -> dict[str, list[Any]]:
        return await scrape(session, kv)

    return await each_worker(kv, metrics)


async def settle(kv: Kvwarm, check: Callable[[dict[str, list[Any]]], bool], within: float = 5.0) -> dict[int, dict[str, list[Any]]]:
    """Scrape every worker until ``check`` holds for all of them (scrape-time gauges of the
    other workers are refreshed once a second)."""
    deadline = time.monotonic() + within
    while True:
        seen = await scrapes(kv)
        if all(check(f) for f in seen.values()) or time.monotonic() > deadline:
            return seen
        await asyncio.sleep(0.2)


@pytest.fixture
async def client_for() -> AsyncIterator[Callable[[Kvwarm], openai.AsyncOpenAI]]:
    """The openai SDK without keep-alive: every request a new connection (so the kernel spreads them)."""
    made: list[openai.AsyncOpenAI] = []

    def make(kv: Kvwarm) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(
            base_url=kv.url + "/v1", api_key="sk-workers", max_retries=0, timeout=30,
            default_headers={"Connection": "close"},
        )
        made.append(client)
        return client

    yield make
    for client in made:
        await client.close()


async def slow_stream(kv: Kvwarm, model: str) -> tuple[aiohttp.ClientSession, aiohttp.ClientResponse, bytes]:
    """A streaming request whose first event has arrived (the response is still open)."""
    session = aiohttp.ClientSession()
    body = orjson.dumps({"model": model, "stream": True, "messages": [{"role": "user", "content": "tell me slowly"}]})
    resp = await session.post(kv.url + "/v1/chat/completions", data=body, headers=STREAM_FAULT)
    assert resp.status == 200
    first = await resp.content.readuntil(b"\n\n")
    return session, resp, first


def inflight(families: dict[str, list[Any]]) -> tuple[float, float]:
    return (
        total(families, "kvwarm_inflight_requests", "kvwarm_inflight_requests"),
        total(families, "kvwarm_upstream_inflight", "kvwarm_upstream_inflight"),
    )


# -- tests ---------------------------------------------------------------------------------------


async def test_requests_spread_and_metrics_from_any_worker_add_up(
    kvwarm: Kvwarm, client_for: Callable[[Kvwarm], openai.AsyncOpenAI]
) -> None:
    model = "spread-" + uuid.uuid4().hex[:6]  # this test's own series in the shared counters
    client = client_for(kvwarm)
    shown = await pages(kvwarm)
    before = {pid: p["totals"]["requests"] for pid, p in shown.items()}
    assert len(before) == 2
    for pid, p in shown.items():  # each page says which worker answered
        assert p["view"]["text"]["process"].startswith(f"worker {pid} of 2 · up ")

    async def ask(i: int) -> Any:
        return await client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}]
        )

    replies = [await ask(0)]  # warms the upstream's cache for the shared system prompt
    replies += await asyncio.gather(*(ask(i) for i in range(1, 24)))
    prompt = sum(r.usage.prompt_tokens for r in replies)
    cached = sum(r.usage.prompt_tokens_details.cached_tokens for r in replies)
    assert cached > 0 and prompt > len(replies) * 1024

    # Each worker's page counts its own requests: both served some, together all of them.
    after = {pid: p["totals"]["requests"] for pid, p in (await pages(kvwarm)).items()}
    assert set(after) == set(before)
    served = {pid: after[pid] - before[pid] for pid in after}
    assert all(n > 0 for n in served.values()), served
    assert sum(served.values()) == len(replies)

    # /metrics from either worker: the totals of both.
    seen = await settle(kvwarm, lambda f: inflight(f) == (0, 0))
    assert set(seen) == set(after)
    for pid, families in seen.items():
        counted = {
            "requests": total(families, "kvwarm_requests", "kvwarm_requests_total", model=model, status="2xx"),
            "prompt": total(families, "kvwarm_prompt_tokens", "kvwarm_prompt_tokens_total", model=model),
            "cached": total(families, "kvwarm_cached_prompt_tokens", "kvwarm_cached_prompt_tokens_total", model=model),
            "known": total(families, "kvwarm_cache_known_prompt_tokens", "kvwarm_cache_known_prompt_tokens_total", model=model),
            "durations": total(families, "kvwarm_request_duration_seconds", "kvwarm_request_duration_seconds_count", model=model),
        }
        sent = {"requests": 24, "prompt": prompt, "cached": cached, "known": prompt, "durations": 24}
        assert counted == sent, f"worker {pid}"
        # Gauges are not counted once per worker: no per-process series, in-flight back to 0, one build.
        assert inflight(families) == (0, 0), f"worker {pid}"
        build = families["kvwarm_build_info"]
        assert [(s.labels.get("version") is not None, s.value) for s in build] == [(True, 1.0)]
        assert not [s for samples in families.values() for s in samples if "pid" in s.labels]
        assert "kvwarm_errors_created" not in families, "the multiprocess exposition (all workers' files)"
        assert total(families, "kvwarm_store_nodes", "kvwarm_store_nodes") > 0


async def test_inflight_of_one_worker_shows_on_every_worker(kvwarm: Kvwarm) -> None:
    session, resp, _ = await slow_stream(kvwarm, "inflight-" + uuid.uuid4().hex[:6])
    try:
        during = await settle(kvwarm, lambda f: inflight(f) == (1, 1))
        for pid, families in during.items():
            assert inflight(families) == (1, 1), f"worker {pid} sees {inflight(families)}"
        rest = await resp.read()
        assert rest.rstrip().endswith(b"data: [DONE]")
    finally:
        resp.close()
        await session.close()
    after = await settle(kvwarm, lambda f: inflight(f) == (0, 0))
    assert all(inflight(f) == (0, 0) for f in after.values()), {pid: inflight(f) for pid, f in after.items()}


async def test_a_killed_worker_is_restarted_and_its_counts_stay(
    kvwarm: Kvwarm, client_for: Callable[[Kvwarm], openai.AsyncOpenAI]
) -> None:
    model = "kill-" + uuid.uuid4().hex[:6]
    client = client_for(kvwarm)
    for i in range(6):
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"before {i}"}])
    workers = children(kvwarm.proc.pid)
    assert len(workers) == 2

    # Kill the worker that holds an open stream, with SIGKILL: it cannot lower its own gauges.
    session, resp, _ = await slow_stream(kvwarm, model)
    try:
        loads = {pid: p["upstreams"][0]["inflight"] for pid, p in (await pages(kvwarm)).items()}
        (victim,) = [pid for pid, n in loads.items() if n == 1]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(aiohttp.ClientError):
            await resp.read()
    finally:
        resp.close()
        await session.close()

    # A new worker takes the slot and serves; the survivor never stopped.
    deadline = time.monotonic() + 20
    while len(children(kvwarm.proc.pid) - {victim}) < 2:
        assert time.monotonic() < deadline, kvwarm.log_tail()
        await asyncio.sleep(0.1)
    now = set(await pages(kvwarm))
    assert victim not in now and len(now & workers) == 1
    for i in range(4):
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"after {i}"}])

    # The dead worker's requests stay counted; its in-flight stream no longer is.
    seen = await settle(kvwarm, lambda f: inflight(f) == (0, 0))
    for pid, families in seen.items():
        assert total(families, "kvwarm_requests", "kvwarm_requests_total", model=model, status="2xx") == 10, f"worker {pid}"
        assert inflight(families) == (0, 0), f"worker {pid}"
    assert f"worker {victim} (slot" in kvwarm.log.read_text() and "restarting" in kvwarm.log.read_text()


async def test_sigterm_finishes_streams_and_stops_every_worker(
    redis: RedisServer, upstream: str, tmp_path: Path
) -> None:
    kv = start_kvwarm(tmp_path, redis.url, upstream)
    try:
        workers = set(await pages(kv))
        (shared,) = {environ(pid).get("PROMETHEUS_MULTIPROC_DIR") for pid in workers}
        assert shared is not None and existing(shared)

        session, resp, first = await slow_stream(kv, "sigterm")
        try:
            kv.proc.send_signal(signal.SIGTERM)
            rest = await resp.read()
        finally:
            resp.close()
            await session.close()
        assert (first + rest).rstrip().endswith(b"data: [DONE]"), "the in-flight stream must finish"
        code = await asyncio.to_thread(kv.proc.wait, 30)
        assert code == 0, kv.log_tail()
        assert not any(existing(f"/proc/{pid}") for pid in workers)
        assert not existing(shared), "the metrics directory is removed at exit"
    finally:
        stop(kv.proc)


async def test_workers_stop_by_themselves_when_the_supervisor_is_killed(
    redis: RedisServer, upstream: str, tmp_path: Path
) -> None:
    kv = start_kvwarm(tmp_path, redis.url, upstream)
    workers: set[int] = set()
    try:
        workers = set(await pages(kv))
        kv.proc.kill()
        await asyncio.to_thread(kv.proc.wait, 10)
        deadline = time.monotonic() + 15
        while any(existing(f"/proc/{pid}") for pid in workers):
            assert time.monotonic() < deadline, f"orphaned workers still running: {workers}"
            await asyncio.sleep(0.1)
        assert "the supervisor (pid" in kv.log.read_text()
    finally:
        stop(kv.proc)
        for pid in workers:  # never leave one behind, even when the test failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def run_kvwarm(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "serve", *args],
        cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--workers", "2", "--store", "memory"], {}),
        (["--workers", "2", "--store", "sqlite:{tmp}/kv.db"], {}),
        (["--store", "memory"], {"KVWARM_SERVER_WORKERS": "3"}),
    ],
    ids=["memory", "sqlite", "environment"],
)
def test_workers_without_a_shared_store_are_a_config_error(args: list[str], env: dict[str, str], tmp_path: Path) -> None:
    done = run_kvwarm("--port", str(free_port()), *(a.format(tmp=tmp_path) for a in args), env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("kvwarm: config error: server.workers:"), done.stderr
    assert "shared store" in done.stderr and "Traceback" not in done.stderr


def test_zero_workers_is_a_config_error(redis: RedisServer) -> None:
    done = run_kvwarm("--workers", "0", "--port", str(free_port()), "--store", redis.url)
    assert done.returncode == 2
    assert done.stderr.startswith("kvwarm: config error: server.workers: must be at least 1"), done.stderr


async def test_one_worker_is_the_single_process(upstream: str, tmp_path: Path) -> None:
    port = free_port()
    kv = spawn(kvwarm_command(port, "--workers", "1", "--store", "memory", "--upstream", upstream), port, tmp_path / "kv.log")
    proc = kv.proc
    try:
        (pid, shown), = (await each_worker(kv, lambda _, first: asyncio.sleep(0, first), want=1)).items()
        assert pid == proc.pid and not children(proc.pid), "no supervisor: the process serves"
        assert shown["view"]["text"]["process"].startswith(f"pid {pid} · up ")
        async with aiohttp.ClientSession() as session:
            families = await scrape(session, kv)
        # The single-process exposition (prometheus-client's multiprocess one has no _created series).
        assert "kvwarm_errors_created" in families
    finally:
        stop(proc)


@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "so_reuseport"])
def test_a_port_in_use_stops_the_supervisor_at_once(reuse_port: bool, redis: RedisServer) -> None:
    # SO_REUSEPORT: another server that could share the port (another kvwarm --workers) is refused too.
    with socket.socket() as taken:
        if reuse_port:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_kvwarm("--workers", "2", "--port", str(port), "--store", redis.url, timeout=30)
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "with 2 workers" not in done.stderr, "no worker was started"


def test_workers_that_keep_dying_at_start_stop_the_supervisor(redis: RedisServer, upstream: str, tmp_path: Path) -> None:
    # A price table that cannot be read fails in each worker, after the supervisor started.
    started = time.monotonic()
    done = run_kvwarm(
        "--workers", "2", "--port", str(free_port()), "--store", redis.url, "--upstream", upstream,
        env={"KVWARM_METRICS_PRICES_FILE": str(tmp_path / "missing.toml")}, timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "with 2 workers" in done.stderr
    assert done.stderr.count("before it was ready") == 5
    assert "workers keep dying at start" in done.stderr
    assert time.monotonic() - started < 30
