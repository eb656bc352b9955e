"""A Responses API session survives a Markdown export and import exactly, and keeps being repaired.

The session holds what a Codex-like agent produces: instructions, user messages, reasoning
items with encrypted content, parallel function calls and their outputs, text replies; and the
agent drifts (tools in another order, arguments re-serialized). Exported with ``kvwarm export``,
the transcript reads back to the same nodes and renders to the same text; imported with ``kvwarm
import`` into a new store (same server secret), it makes a new kvwarm repair the agent's next
request exactly as the first one would have: the upstream receives what a never-drifting client
sends.
"""

from __future__ import annotations

import argparse
import asyncio
import io
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp.test_utils import TestServer

from proxy.config import Settings, load_settings
from proxy.core import transcript_md
from proxy.core.policy import Policy
from proxy.ops import inspect_cli
from tests.conftest import ProxyFactory, received
from tests.responses.agents import (
    Items,
    ResponsesAgent,
    Tools,
    args_python_dumps,
    poster,
    render_request,
    tools_reordered,
)

SECRET = "responses-shared-secret"
REQUESTS = 4


def drift(items: Items, tools: Tools, turn: int) -> tuple[Items, Tools]:
    items, tools = tools_reordered(items, tools, turn)
    return args_python_dumps(items, tools, turn)


def cli_settings(db: Path) -> Settings:
    return load_settings(None, env={}, overrides={"store.backend": f"sqlite:{db}", "store.secret": SECRET})


async def cli(name: str, settings: Settings, **args: Any) -> tuple[int, str, str]:
    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        status = inspect_cli.run(name, argparse.Namespace(**args), settings, stdout=out, stderr=err)
        return status, out.getvalue(), err.getvalue()

    return await asyncio.to_thread(run)


async def get(server: TestServer, path: str) -> bytes:
    async with aiohttp.ClientSession() as s, s.get(server.make_url(path)) as r:
        assert r.status == 200, await r.text()
        return await r.read()


async def only_session(server: TestServer) -> str:
    (session,) = orjson.loads(await get(server, "/kvwarm/sessions"))["data"]
    return str(session["id"])


async def test_a_responses_session_round_trips_through_markdown(
    make_sim: Any, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    sim = await make_sim()
    first = await make_proxy(sim, store__backend=f"sqlite:{tmp_path / 'a.db'}", store__secret=SECRET)
    agent = ResponsesAgent(poster(first), drift=drift, reasoning=True, parallel=True)
    await agent.run(REQUESTS)
    assert sum(int(t.prefix()["repaired"]) for t in agent.turns) > 0
    session = await only_session(first)
    shown = await get(first, f"/kvwarm/sessions/{session}.md")
    await first.close()  # flushes the store: the export reads the file

    status, out, err = await cli("export", cli_settings(tmp_path / "a.db"), dir=str(tmp_path / "export"))
    assert status == 0, err
    (exported,) = (Path(p) for p in out.split())
    text = exported.read_bytes()
    assert text == shown  # the file and the admin API write the same transcript

    # The transcript reads back whole and renders to the same bytes.
    transcript = transcript_md.parse(text, Policy())
    assert transcript.session.hex() == session
    assert transcript_md.render(transcript).encode() == text
    bodies = [orjson.loads(n.body) for n in transcript.nodes]
    roles = [n.role for n in transcript.nodes]
    assert roles[:3] == ["tools", "system", "user"]
    assert {"assistant", "tool"} <= set(roles)
    assert any("encrypted_content" in b for b in bodies[1:]), "the reasoning items are in the transcript"
    assert sum(1 for n in transcript.nodes if n.generated) >= REQUESTS

    # Imported into a new store under the same secret: the same session, byte for byte.
    status, out, err = await cli("import", cli_settings(tmp_path / "b.db"), dir=str(tmp_path / "export"), tenant_key=None)
    assert status == 0, err
    assert ": imported: session " in out

    # What a never-drifting client sends next: the reference for the forwarded request.
    clean_sim = await make_sim()
    await ResponsesAgent(poster(clean_sim), reasoning=True, parallel=True).run(REQUESTS + 1)
    clean_next = render_request(orjson.loads(received(clean_sim)[-1].body))

    # Control: a kvwarm that never saw the session forwards the drift as sent.
    control_sim = await make_sim()
    control = await make_proxy(control_sim, store__backend=f"sqlite:{tmp_path / 'c.db'}", store__secret=SECRET)
    control_turn = await poster(control)(agent.next_request(), agent.headers())
    assert "repaired=0" in control_turn["_headers"]["x-kvwarm-prefix"]
    assert render_request(orjson.loads(received(control_sim)[-1].body)) != clean_next

    second = await make_proxy(sim, store__backend=f"sqlite:{tmp_path / 'b.db'}", store__secret=SECRET)
    assert await get(second, f"/kvwarm/sessions/{session}.md") == text
    agent.post = poster(second)
    turn = await agent.step()
    fields = turn.prefix()
    carried = 1 + sum(1 for item in turn.request["input"][: turn.resent] if item.get("type") != "reasoning")
    assert int(fields["repaired"]) > 0 and "break" not in fields
    assert fields["matched"].startswith(f"{carried}/")
    assert render_request(orjson.loads(received(sim)[-1].body)) == clean_next  # the stored form went upstream
    assert turn.cached > 0
