"""The real Claude Code CLI through kvwarm to the reference upstream (Anthropic's Messages API).

Three runs of ``claude -p`` in one temporary HOME: a task that runs a shell command, then
``--continue``, then ``--resume <session id>``; each run is two requests (a ``tool_use``, then
the answer to its ``tool_result``). A recording hop between Claude Code and kvwarm keeps each
response's ``x-kvwarm-prefix``: every request after the first continues the stored prefix --
everything the request before it sent and the reply it got -- with no break (drift, if any, is
repaired); the upstream's cache (``anthropic`` mode, Claude Code's own ``cache_control``
markers) is read; the session is in the admin API under the key's tenant.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.clients.claude_code import MODEL, THROWAWAY_KEY, find_claude, run_claude
from tests.conftest import ProxyFactory, received

pytestmark = pytest.mark.timeout(300)  # the real Claude Code CLI, each run bounded at 90 s
PROMPT = "Run `echo kvwarm` in the shell, then say done."
_HOP = frozenset(("host", "content-length", "connection", "transfer-encoding", "keep-alive"))


@pytest.fixture
def claude_bin() -> Path:
    """The Claude Code launcher; skips the test, saying why, when it is not installed."""
    path = find_claude()
    if path is None:
        pytest.skip("@anthropic-ai/claude-code not installed: run .ci/install/claude.sh")
    return path


@dataclass
class Exchange:
    path: str
    request: bytes
    headers: dict[str, str] = field(default_factory=dict)
    """kvwarm's response headers."""

    def prefix(self) -> dict[str, str]:
        return dict(p.split("=", 1) for p in self.headers.get("x-kvwarm-prefix", "").split("; ") if "=" in p)

    def counts(self) -> tuple[int, int]:
        matched, total = self.prefix()["matched"].split("/")
        return int(matched), int(total)


async def recording_hop(aiohttp_server: Callable[..., Awaitable[TestServer]], target: TestServer) -> tuple[TestServer, list[Exchange]]:
    """A pass-through to ``target`` that keeps each request and kvwarm's response headers."""
    exchanges: list[Exchange] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        exchange = Exchange(request.path_qs, await request.read())
        exchanges.append(exchange)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with aiohttp.ClientSession(auto_decompress=False) as session, session.request(
            request.method, target.make_url(request.path_qs), data=exchange.request, headers=headers
        ) as answer:
            exchange.headers = {k.lower(): v for k, v in answer.headers.items()}
            passed = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP}
            out = web.StreamResponse(status=answer.status, headers=passed)
            await out.prepare(request)
            async for chunk in answer.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return await aiohttp_server(app), exchanges


def _tool_results(body: bytes) -> list[str]:
    messages = orjson.loads(body)["messages"]
    return [
        str(block.get("content"))
        for m in messages if m["role"] == "user" and isinstance(m["content"], list)
        for block in m["content"] if block.get("type") == "tool_result"
    ]


async def test_claude_code_continues_and_resumes_its_session_on_a_warm_prefix(
    claude_bin: Path, make_sim: Any, make_proxy: ProxyFactory, aiohttp_server: Any, tmp_path: Path
) -> None:
    sim = await make_sim(cache_mode="anthropic")
    kvwarm = await make_proxy(sim)
    hop, exchanges = await recording_hop(aiohttp_server, kvwarm)
    base = str(hop.make_url("")).rstrip("/")
    home, work = tmp_path / "home", tmp_path / "work"

    first = await run_claude(base, PROMPT, home=home, workdir=work)
    assert first.returncode == 0, first.summary()
    session = first.result["session_id"]
    again = await run_claude(base, "Now run it once more.", home=home, workdir=work, extra_args=("--continue",))
    assert again.returncode == 0, again.summary()
    resumed = await run_claude(base, "And once more.", home=home, workdir=work, extra_args=("--resume", session))
    assert resumed.returncode == 0, resumed.summary()
    assert again.result["session_id"] == resumed.result["session_id"] == session

    turns = [e for e in exchanges if e.path.split("?")[0] == "/v1/messages"]
    assert len(turns) == 6, [e.path for e in exchanges]
    assert all(e.path.endswith("?beta=true") for e in turns)  # forwarded with its query
    assert any("kvwarm" in result for result in _tool_results(turns[1].request)), "the command ran"
    for before, turn in itertools.pairwise(turns):
        prefix = turn.prefix()
        assert "break" not in prefix, prefix
        # Everything the request before sent, and the reply it got (streamed, thinking and tool
        # use), is matched: rescued by a repair where Claude Code drifted.
        assert turn.counts()[0] == before.counts()[1] + 1, (before.prefix(), prefix)
    # The upstream read Claude Code's marked prefix on every request after the first.
    for run in (first, again, resumed):
        assert run.result["usage"]["cache_read_input_tokens"] > 0, run.result["usage"]

    # The upstream saw the client's requests, repaired or as sent, and kvwarm recorded the session.
    assert len([r for r in received(sim) if r.endpoint == "messages"]) == 6
    async with aiohttp.ClientSession() as client, client.get(
        kvwarm.make_url("/kvwarm/sessions"), headers={"x-api-key": THROWAWAY_KEY}
    ) as listed:
        assert listed.status == 200
        sessions = (await listed.json())["data"]
    (ours,) = [s for s in sessions if s["model"] == MODEL]
    assert ours["turns"] == 6 and ours["last_break"] is None
    assert ours["cached_tokens"] > 0 and ours["messages"] > turns[-1].counts()[1]
