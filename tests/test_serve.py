"""``kvwarm serve`` as a user runs it: a real process, SIGTERM while a stream is in flight."""

from __future__ import annotations

import asyncio
import signal
import socket
import sqlite3
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from proxy.sim.server import SimConfig, create_sim_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def wait_ready(url: str, proc: asyncio.subprocess.Process) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            if proc.returncode is not None:
                raise AssertionError(f"kvwarm exited early with {proc.returncode}")
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("kvwarm did not become ready")


async def test_sigterm_finishes_inflight_stream_and_flushes_the_store(aiohttp_server: Any, tmp_path: Path) -> None:
    sim = await aiohttp_server(create_sim_app(SimConfig(chunk_delay=0.05)))
    port, db = free_port(), tmp_path / "kv.db"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--port", str(port),
        "--upstream", str(sim.make_url("/v1")), "--store", f"sqlite:{db}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        await wait_ready(f"http://127.0.0.1:{port}/readyz", proc)
        body = orjson.dumps({"model": "kvwarm-sim", "stream": True, "messages": [{"role": "user", "content": "tell me"}]})
        async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={"x-sim-reply-tokens": "60"}
        ) as r:
            first = await r.content.readuntil(b"\n\n")
            proc.send_signal(signal.SIGTERM)
            rest = await r.read()
        stream = first + rest
        assert stream.rstrip().endswith(b"data: [DONE]"), "the in-flight stream must finish"
        assert b'"finish_reason":"stop"' in stream
        code = await asyncio.wait_for(proc.wait(), 30)
        assert code == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    with sqlite3.connect(db) as conn:
        roles = [row[0] for row in conn.execute("SELECT role FROM nodes ORDER BY depth")]
    assert roles == ["tools", "user", "assistant"], "the turn was flushed to sqlite before exit"
