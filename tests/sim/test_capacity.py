"""A bounded KV capacity (``kv_capacity_tokens`` / ``--kv-capacity-tokens``): sessions evict each other.

Each session's footprint in blocks is measured on an unbounded emulator; a
second emulator then gets room for exactly two sessions, so a third evicts the
least recently used one — on both endpoints, and through the command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from proxy.sim.state import SIM_STATE, SimConfig, cache_for
from tests.sim.conftest import long_system_prompt

REPO = Path(__file__).resolve().parents[2]
MakeSim = Callable[..., Awaitable[TestServer]]
Post = Callable[[str, str], Awaitable[int]]


def session_body(endpoint: str, name: str) -> dict[str, Any]:
    """Session ``name``'s request: its own system prompt from the first block on, ~600 tokens."""
    system = f"Session {name} only. " + long_system_prompt(60)
    if endpoint == "responses":
        return {"model": "m", "instructions": system, "input": "Go on."}
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Go on."}],
    }


def cached_of(endpoint: str, payload: dict[str, Any]) -> int:
    usage = payload["usage"]
    details = usage["input_tokens_details" if endpoint == "responses" else "prompt_tokens_details"]
    value: int = details["cached_tokens"]
    return value


def poster(base_url: str) -> Post:
    """``await post(endpoint, session)``: one session's request; its cached tokens."""

    async def post(endpoint: str, name: str) -> int:
        path = "/responses" if endpoint == "responses" else "/chat/completions"
        async with (
            aiohttp.ClientSession() as session,
            session.post(base_url + path, json=session_body(endpoint, name)) as reply,
        ):
            assert reply.status == 200, await reply.text()
            return cached_of(endpoint, await reply.json())

    return post


async def footprint(make_sim: MakeSim, endpoint: str) -> int:
    """Blocks one session leaves in an unbounded vLLM-mode cache (the prompt and the reply)."""
    server = await make_sim(cache_mode="vllm")
    post = poster(str(server.make_url("/v1")))
    await post(endpoint, "A")
    blocks = len(server.app[SIM_STATE].cache)
    await post(endpoint, "B")
    assert len(server.app[SIM_STATE].cache) == 2 * blocks  # equal sizes, nothing shared
    return blocks


async def three_sessions(post: Post, endpoint: str) -> tuple[int, int]:
    """A, B, C once each; then B and A again: their cached tokens."""
    for name in "ABC":
        assert await post(endpoint, name) == 0
    return await post(endpoint, "B"), await post(endpoint, "A")


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
async def test_a_third_session_evicts_the_first(make_sim: MakeSim, endpoint: str) -> None:
    blocks = await footprint(make_sim, endpoint)
    bounded = await make_sim(cache_mode="vllm", kv_capacity_tokens=2 * blocks * 16)
    cache = bounded.app[SIM_STATE].cache
    b_again, a_again = await three_sessions(poster(str(bounded.make_url("/v1"))), endpoint)
    assert b_again > 0  # B was more recent than A: kept
    assert a_again == 0  # A's blocks went to C
    assert len(cache) == 2 * blocks

    unbounded = await make_sim(cache_mode="vllm")
    b_kept, a_kept = await three_sessions(poster(str(unbounded.make_url("/v1"))), endpoint)
    assert (b_kept, a_kept) == (b_again, b_again)  # without the bound, A is still there


def test_capacity_is_counted_in_blocks_of_the_mode() -> None:
    assert cache_for(SimConfig(cache_mode="vllm", kv_capacity_tokens=1000)).capacity == 62
    assert cache_for(SimConfig(kv_capacity_tokens=1000)).capacity == 7
    assert cache_for(SimConfig()).capacity == SimConfig().capacity_blocks
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        SimConfig(kv_capacity_tokens=100)  # less than one 128-token block
    SimConfig(cache_mode="vllm", kv_capacity_tokens=100)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def command_line_sim(*flags: str) -> AsyncIterator[str]:
    """``kvwarm upstream-sim FLAGS`` in a subprocess; yields its base URL once it answers."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy",
        "upstream-sim",
        "--port",
        str(port),
        *flags,
        cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(200):
                if process.returncode is not None:
                    assert process.stderr is not None
                    pytest.fail(f"upstream-sim exited: {(await process.stderr.read()).decode()}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(base_url + "/models") as reply:
                        if reply.status == 200:
                            break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("upstream-sim did not answer within 10 s")
        yield base_url
    finally:
        if process.returncode is None:
            process.terminate()
        await asyncio.wait_for(process.wait(), timeout=10)


async def test_the_command_line_flag_bounds_the_cache(make_sim: MakeSim) -> None:
    blocks = await footprint(make_sim, "chat")
    flags = ("--cache", "vllm", "--kv-capacity-tokens", str(2 * blocks * 16))
    async with command_line_sim(*flags) as base_url:
        b_again, a_again = await three_sessions(poster(base_url), "chat")
    assert b_again > 0 and a_again == 0


async def test_the_command_line_refuses_a_capacity_below_one_block() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy",
        "upstream-sim",
        "--port",
        str(free_port()),
        "--kv-capacity-tokens",
        "10",
        cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 2
    assert b"kv_capacity_tokens" in stderr
