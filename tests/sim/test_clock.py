"""The emulator's clock: in process, over ``/sim/clock``, and in a ``kvwarm upstream-sim`` process."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.cli import build_parser
from proxy.sim.clock import SimClock
from proxy.sim.server import SIM_STATE
from tests.sim.conftest import ClientFactory, long_system_prompt


def test_a_clock_is_its_source_plus_what_it_was_advanced() -> None:
    clock = SimClock(lambda: 100.0)
    assert clock() == 100.0
    assert clock.advance(30) == 130.0
    assert (clock(), clock.offset) == (130.0, 30.0)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            clock.advance(bad)


async def test_the_clock_endpoint_reads_and_advances_the_clock(sim_client: ClientFactory) -> None:
    client = await sim_client()
    before = await (await client.get("/sim/clock")).json()
    after = await (await client.post("/sim/clock", json={"advance": 600})).json()
    assert after["offset"] == before["offset"] + 600
    assert after["now"] >= before["now"] + 600
    assert client.app[SIM_STATE].clock.offset == 600
    await client.post("/sim/reset")
    assert client.app[SIM_STATE].clock.offset == 600  # a reset does not turn time back
    for body in ({"advance": -5}, {"advance": "soon"}, {"advance": True}):
        response = await client.post("/sim/clock", json=body)
        assert response.status == 400
        assert (await response.json())["error"]["param"] == "advance"
    assert (await client.post("/sim/clock", data=b"not json")).status == 400


async def test_advancing_the_clock_expires_block_cache_entries_too(sim_client: ClientFactory) -> None:
    client = await sim_client(cache_mode="vllm", ttl_seconds=60)
    body = {"messages": [{"role": "user", "content": long_system_prompt(5)}]}

    async def cached() -> int:
        response = await client.post("/v1/chat/completions", data=orjson.dumps(body))
        value: int = (await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
        return value

    await cached()
    assert await cached() > 0
    await client.post("/sim/clock", json={"advance": 61})
    assert await cached() == 0


def test_the_cli_takes_the_breakpoint_modes_and_their_flags() -> None:
    args = build_parser().parse_args(
        ["upstream-sim", "--cache", "openai-breakpoints", "--implicit-ttl", "300", "--anthropic-usage"]
    )
    assert (args.cache, args.implicit_ttl, args.anthropic_usage) == ("openai-breakpoints", 300.0, True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_an_upstream_sim_process_expires_breakpoints_when_its_clock_is_advanced() -> None:
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "upstream-sim", "--port", str(port),
        "--cache", "openai-breakpoints",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    root = f"http://127.0.0.1:{port}"
    body = {"messages": [{"role": "system", "content": long_system_prompt()}, {"role": "user", "content": "Hi."}]}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            await _wait_until_up(session, root)

            async def usage() -> Any:
                async with session.post(f"{root}/v1/chat/completions", json=body) as response:
                    return (await response.json())["usage"]["prompt_tokens_details"]

            written = (await usage())["cache_write_tokens"]
            assert (await usage())["cached_tokens"] == written > 1024
            async with session.post(f"{root}/sim/clock", json={"advance": 31 * 60}) as response:
                assert response.status == 200
            assert await usage() == {"cached_tokens": 0, "cache_write_tokens": written, "audio_tokens": 0}
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        await asyncio.wait_for(process.wait(), 30)


async def _wait_until_up(session: aiohttp.ClientSession, root: str) -> None:
    for _ in range(300):
        try:
            async with session.get(f"{root}/v1/models") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("the upstream-sim process did not start")
