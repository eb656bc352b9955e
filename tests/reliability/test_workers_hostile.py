"""``kvwarm serve --workers 2`` against what breaks a supervisor: a current directory that holds
its own ``proxy`` package, and worker slots whose workers cannot start.

Real processes, as in tests/scale/test_workers.py (whose helpers these tests use):
``redis-server``, the reference upstream and kvwarm on free loopback ports. A worker is made
unable to start the way it happens in production: the price table it reads at start-up is
missing (it exits with status 2), or Redis is down. Every request opens a new connection (the
kernel picks the worker) and must be answered within :data:`ANSWER_WITHIN` seconds: a
connection left hanging fails the test.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import aiohttp
import orjson
import pytest

from proxy.ops.workers import MAX_START_FAILURES
from tests.scale.test_workers import (
    PAGE,
    REPO,
    Kvwarm,
    children,
    pages,
    slow_stream,
    start_kvwarm,
    stop,
    upstream,  # noqa: F401 - the module's reference upstream (a fixture)
)
from tests.store.redis_server import HOST, RedisServer, binaries_missing, free_port

ANSWER_WITHIN = 5.0
"""Seconds a request may take, from its connection to its last byte."""
FAILED_START = "before it was ready"
"""What the supervisor logs for each worker that exited before it was ready."""
HOSTILE = """\
import pathlib, sys
pathlib.Path({marker!r}).write_text(__name__ + "\\n")
sys.exit(1)
"""
"""Every module of the hostile directory: it leaves a marker and fails."""


def failed_starts(kv: Kvwarm) -> int:
    return kv.log.read_text(errors="replace").count(FAILED_START)


async def wait_for(what: Callable[[], bool], kv: Kvwarm, within: float, why: str) -> None:
    deadline = time.monotonic() + within
    while not what():
        assert time.monotonic() < deadline, f"{why}:\n{kv.log_tail()}"
        await asyncio.sleep(0.1)


async def answered(kv: Kvwarm) -> int:
    """One request on a new connection: the live page, answered in time; the worker's pid."""
    timeout = aiohttp.ClientTimeout(total=ANSWER_WITHIN)
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        try:
            async with session.get(kv.url + PAGE) as r:
                assert r.status == 200, await r.text()
                pid: int = orjson.loads(await r.read())["process"]["pid"]
                return pid
        except TimeoutError:
            pytest.fail(f"a request hung for {ANSWER_WITHIN}s:\n{kv.log_tail()}")
        except aiohttp.ClientError as exc:
            pytest.fail(f"a request failed ({exc!r}):\n{kv.log_tail()}")


async def chat(kv: Kvwarm, text: str) -> None:
    """A chat completion through kvwarm on a new connection, answered in time."""
    body = orjson.dumps({"model": "hostile", "messages": [{"role": "user", "content": text}]})
    timeout = aiohttp.ClientTimeout(total=ANSWER_WITHIN)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as session:
        try:
            async with session.post(kv.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200, await r.text()
                assert orjson.loads(await r.read())["choices"][0]["message"]["content"]
        except TimeoutError:
            pytest.fail(f"a request hung for {ANSWER_WITHIN}s:\n{kv.log_tail()}")
        except aiohttp.ClientError as exc:
            pytest.fail(f"a request failed ({exc!r}):\n{kv.log_tail()}")


async def served_until(kv: Kvwarm, done: Callable[[], bool], within: float) -> set[int]:
    """Requests, one after another, until ``done()``: every one answered, the supervisor
    running throughout. The pids that answered."""
    pids: set[int] = set()
    deadline = time.monotonic() + within
    i = 0
    while not done():
        assert time.monotonic() < deadline, f"still waiting after {within}s:\n{kv.log_tail()}"
        assert kv.proc.poll() is None, f"kvwarm exited {kv.proc.returncode}:\n{kv.log_tail()}"
        pids.add(await answered(kv))
        await chat(kv, f"question {i}")
        i += 1
    return pids


def refused(port: int) -> bool:
    """A connection to ``port`` is refused at once (rather than accepted and left unanswered)."""
    try:
        socket.create_connection((HOST, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    except TimeoutError:
        pytest.fail("a connection attempt hung")
    return False


async def kill(kv: Kvwarm, pids: set[int]) -> None:
    """SIGKILL ``pids`` (workers of ``kv``) and wait until they are gone: a connection the kernel
    queued on a worker's socket in its last instant is reset, and would fail the test for
    reasons of its own."""
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    await wait_for(lambda: not pids & children(kv.proc.pid), kv, 10, f"workers {pids} are still there")


def spawn_in(cwd: Path, command: list[str], port: int, log: Path, env: dict[str, str]) -> Kvwarm:
    """``command`` started in ``cwd``, with ``env`` less ``PYTHONPATH`` (as a user runs kvwarm)."""
    env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Kvwarm(proc, port, log)


def move(source: Path, target: Path) -> Path:
    return source.rename(target)


def works_in(pid: int, directory: Path) -> bool:
    """``pid``'s current directory is ``directory``."""
    return Path(os.readlink(f"/proc/{pid}/cwd")) == directory


# -- failure 8: the current directory's own ``proxy`` ---------------------------------------------


def kvwarm_script() -> Path:
    """The installed ``kvwarm`` command of this interpreter's environment (``pip install -e .``)."""
    script = Path(sys.executable).with_name("kvwarm")
    assert script.is_file(), f"kvwarm is not installed beside {sys.executable} (make installs it)"
    return script


async def test_workers_run_the_installed_kvwarm_whatever_the_current_directory_holds(
    redis: RedisServer, upstream: str, tmp_path: Path  # noqa: F811
) -> None:
    here = tmp_path / "project"
    (here / "proxy").mkdir(parents=True)
    marker = tmp_path / "hostile-code-ran"
    for name in ("proxy/__init__.py", "proxy/__main__.py", "proxy/cli.py", "orjson.py", "aiohttp.py"):
        (here / name).write_text(HOSTILE.format(marker=str(marker)))
    port = free_port()
    env = {**os.environ, "KVWARM_STORE_REDIS_PREFIX": f"t{uuid.uuid4().hex[:10]}", "KVWARM_LOG_LEVEL": "WARNING"}
    command = [str(kvwarm_script()), "serve", "--port", str(port), "--workers", "2", "--store", redis.url, "--upstream", upstream]
    kv = spawn_in(here, command, port, tmp_path / "kvwarm.log", env)
    try:
        workers = set(await pages(kv))
        await chat(kv, "hello")
        assert not marker.exists(), f"the current directory's code ran: {marker.read_text()}"
        # The workers keep the directory: relative paths in the settings mean what they meant.
        assert all(works_in(pid, here) for pid in workers)
    finally:
        stop(kv.proc)
    assert kv.proc.returncode == 0, kv.log_tail()


async def test_a_checkout_run_with_python_m_proxy_starts_workers_of_that_checkout(
    redis: RedisServer, upstream: str, tmp_path: Path  # noqa: F811
) -> None:
    # Not the installed kvwarm: a copy of the package, run with -m from its own root.
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "proxy", checkout / "proxy", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    with (checkout / "proxy" / "__init__.py").open("a") as init:
        init.write('\n__version__ = "0.0.0+the-checkout"\n')
    port = free_port()
    env = {**os.environ, "KVWARM_STORE_REDIS_PREFIX": f"t{uuid.uuid4().hex[:10]}", "KVWARM_LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "proxy", "serve", "--port", str(port), "--workers", "2", "--store", redis.url, "--upstream", upstream]
    kv = spawn_in(checkout, command, port, tmp_path / "kvwarm.log", env)
    try:
        shown = await pages(kv)
        assert {page["version"] for page in shown.values()} == {"0.0.0+the-checkout"}
        await chat(kv, "hello")
    finally:
        stop(kv.proc)
    assert kv.proc.returncode == 0, kv.log_tail()


# -- failure 9: a slot whose worker cannot start ---------------------------------------------------


@pytest.fixture
def prices(tmp_path: Path) -> Path:
    """A price table the workers read at start-up; a worker started while it is missing fails."""
    path = tmp_path / "prices.toml"
    path.write_text('[models."gpt-4o"]\ninput = 2.5\noutput = 10.0\n')
    return path


async def test_a_slot_that_cannot_start_leaves_the_others_serving_until_it_can(
    redis: RedisServer, upstream: str, prices: Path, tmp_path: Path  # noqa: F811
) -> None:
    kv = start_kvwarm(tmp_path, redis.url, upstream, KVWARM_METRICS_PRICES_FILE=str(prices))
    try:
        victim, survivor = sorted(await pages(kv))
        away = move(prices, tmp_path / "prices.away")
        await kill(kv, {victim})
        # The victim's slot fails to start again and again: every request is answered
        # meanwhile, by the survivor (none waits on the slot's socket for a worker to come).
        seen = await served_until(kv, lambda: failed_starts(kv) >= 2, within=20)
        assert seen == {survivor}
        assert kv.proc.poll() is None, kv.log_tail()

        move(away, prices)  # the cause is gone: the slot gets a worker again
        now = set(await pages(kv))
        assert survivor in now and victim not in now and len(now) == 2
        await chat(kv, "after")
    finally:
        stop(kv.proc)
    assert kv.proc.returncode == 0, kv.log_tail()


async def test_with_no_worker_serving_connections_are_refused_and_the_supervisor_waits(
    redis: RedisServer, upstream: str, prices: Path, tmp_path: Path  # noqa: F811
) -> None:
    kv = start_kvwarm(tmp_path, redis.url, upstream, KVWARM_METRICS_PRICES_FILE=str(prices))
    try:
        workers = set(await pages(kv))
        away = move(prices, tmp_path / "prices.away")
        await kill(kv, workers)
        # Both slots fail to start, more often than the supervisor tolerates before any worker
        # ever served: since workers did serve, it keeps trying, and refuses connections meanwhile.
        await wait_for(lambda: failed_starts(kv) >= MAX_START_FAILURES, kv, 20, "the slots were not retried")
        assert refused(kv.port), "a connection was accepted with no worker to serve it"
        assert kv.proc.poll() is None, kv.log_tail()

        move(away, prices)
        now = set(await pages(kv))
        assert len(now) == 2 and not now & workers
        await chat(kv, "after")
    finally:
        stop(kv.proc)
    assert kv.proc.returncode == 0, kv.log_tail()


async def test_a_worker_dying_while_redis_is_down_is_replaced_once_redis_is_back(
    upstream: str, tmp_path: Path  # noqa: F811
) -> None:
    if (why := binaries_missing()) is not None:
        pytest.skip(why)
    redis = RedisServer(tmp_path / "redis").start()
    kv = start_kvwarm(tmp_path, redis.url, upstream)
    try:
        victim, survivor = sorted(await pages(kv))
        redis.kill()
        await kill(kv, {victim})
        # Whether the victim's replacement can start with Redis down or not, every request is
        # answered, and the supervisor keeps running.
        until = time.monotonic() + 3
        await served_until(kv, lambda: time.monotonic() > until, within=15)

        redis.start()
        now = set(await pages(kv))
        assert survivor in now and victim not in now and len(now) == 2
        await chat(kv, "after")
    finally:
        stop(kv.proc)
        redis.stop()
    assert kv.proc.returncode == 0, kv.log_tail()


async def test_a_stopping_kvwarm_refuses_new_connections_while_it_finishes_streams(
    redis: RedisServer, upstream: str, tmp_path: Path  # noqa: F811
) -> None:
    # A worker that stops taking connections takes its socket with it: nothing queues a new
    # connection for a worker that will never accept it.
    kv = start_kvwarm(tmp_path, redis.url, upstream)
    try:
        await pages(kv)
        session, resp, first = await slow_stream(kv, "stopping")
        try:
            kv.proc.send_signal(signal.SIGTERM)
            await wait_for(lambda: refused(kv.port), kv, 3, "new connections were still accepted")
            assert not resp.content.at_eof(), "the stream must still be running"
            rest = await resp.read()
        finally:
            resp.close()
            await session.close()
        assert (first + rest).rstrip().endswith(b"data: [DONE]"), "the in-flight stream must finish"
        assert await asyncio.to_thread(kv.proc.wait, 30) == 0, kv.log_tail()
    finally:
        stop(kv.proc)
