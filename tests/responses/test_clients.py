"""Real Responses API clients through kvwarm: the Codex CLI and openai-agents, in front of the reference upstream.

A recording hop stands between the client and kvwarm, so the tests read what kvwarm answered
(``x-kvwarm-prefix``) besides what the upstream received. Skipped, with the reason, when a
client is not installed (``.ci/install/codex.sh``; ``pip install openai-agents``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.core import transcript_md
from proxy.core.policy import Policy
from tests.clients.agents import run_agent, weather_report
from tests.clients.codex import run_codex
from tests.conftest import ProxyFactory, received, store_of
from tests.responses.conftest import Exchange, Recorder

pytestmark = pytest.mark.timeout(300)  # the real Codex CLI (two runs in one test, 90 s each at most)
PROMPT = "Run `echo kvwarm` in the shell, then say done."


def prefix(exchange: Exchange) -> dict[str, str]:
    return dict(p.split("=", 1) for p in exchange.headers["x-kvwarm-prefix"].split("; "))


def matched(exchange: Exchange) -> int:
    return int(prefix(exchange)["matched"].split("/")[0])


async def get_json(server: TestServer, path: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(server.make_url(path)) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def metric_total(server: TestServer, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(server.make_url("/metrics")) as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " "))


def view_elements(body: dict[str, Any]) -> int:
    """Elements of a Responses request as kvwarm counts them: instructions, then every item but reasoning."""
    items = body["input"] if isinstance(body["input"], list) else [body["input"]]
    return (1 if body.get("instructions") else 0) + sum(1 for i in items if i.get("type") != "reasoning")


async def test_codex_sessions_are_recorded_metered_and_shared(
    codex_bin: Path, make_sim: Any, make_proxy: ProxyFactory, recording: Recorder, tmp_path: Path
) -> None:
    sim = await make_sim()
    proxy = await make_proxy(sim)
    hop = await recording(proxy)
    url = str(hop.server.make_url("/v1"))

    run = await run_codex(url, PROMPT, workdir=tmp_path / "one", timeout=90)
    assert run.returncode == 0, run.summary()
    posts = [e for e in hop.exchanges if e.path == "/v1/responses"]
    assert len(posts) >= 2, run.summary()
    first, second = orjson.loads(posts[0].request), orjson.loads(posts[1].request)
    new_items = second["input"][len(first["input"]):]
    assert [i["type"] for i in new_items if i["type"].startswith("function_call")] == ["function_call", "function_call_output"]
    assert [c["exit_code"] for c in run.items("command_execution")] == [0], run.summary()
    # Codex re-sends turn 1 and the upstream's output items (re-serialized): all recognised, nothing broke.
    fields = prefix(posts[1])
    assert "break" not in fields, fields
    assert matched(posts[1]) == view_elements(second) - 1  # all but the new function_call_output
    assert [r.body for r in received(sim)] == [e.request for e in posts]  # nothing needed repair

    # kvwarm's sessions: the run is one session, with its hit % and cost.
    listing = (await get_json(proxy, "/kvwarm/sessions"))["data"]
    assert len(listing) == 1
    session = listing[0]
    assert session["turns"] == len(posts)
    assert session["cache_hit_pct"] is not None and session["cache_hit_pct"] > 0
    assert session["cost_usd"] > 0
    usage = [orjson.loads(e.response.rsplit(b"data: ", 1)[1])["response"]["usage"] for e in posts]
    assert session["prompt_tokens"] == sum(u["input_tokens"] for u in usage)
    assert session["cached_tokens"] == sum(u["input_tokens_details"]["cached_tokens"] for u in usage)
    (info,) = store_of(proxy).sessions()
    assert info.leaf.hex() == session["id"]
    # ... and the metrics counted its requests.
    assert await metric_total(proxy, "kvwarm_requests_total") == len(posts)

    # A second run: another thread, new item ids everywhere, the same base instructions.
    done = len(posts)
    run2 = await run_codex(url, PROMPT, workdir=tmp_path / "one", timeout=90)
    assert run2.returncode == 0, run2.summary()
    posts2 = [e for e in hop.exchanges if e.path == "/v1/responses"][done:]
    again = orjson.loads(posts2[0].request)
    ids = {i.get("id") for i in first["input"]} & {i.get("id") for i in again["input"]}
    assert ids <= {None}, "Codex gave the second session new item ids"
    assert again["input"][0]["content"] == first["input"][0]["content"]  # the developer instructions
    # The base instructions (and the tools) match; the next developer message names this run's
    # CODEX_HOME, so the new session leaves the tree there.
    assert matched(posts2[0]) >= 1, prefix(posts2[0])
    assert len((await get_json(proxy, "/kvwarm/sessions"))["data"]) == 2
    assert await metric_total(proxy, "kvwarm_requests_total") == len(posts) + len(posts2)


async def test_codex_code_mode_session_is_recognised_whole(
    codex_bin: Path, make_sim: Any, make_proxy: ProxyFactory, recording: Recorder, tmp_path: Path
) -> None:
    """Codex's default model: tools in an ``additional_tools`` item, commands as ``custom_tool_call``
    items (which Codex re-serializes with its keys in another order)."""
    sim = await make_sim()
    proxy = await make_proxy(sim)
    hop = await recording(proxy)
    run = await run_codex(str(hop.server.make_url("/v1")), PROMPT, workdir=tmp_path / "work", timeout=90, model=None)
    assert run.returncode == 0, run.summary()
    posts = [e for e in hop.exchanges if e.path == "/v1/responses"]
    assert len(posts) >= 2, run.summary()
    second = orjson.loads(posts[1].request)
    assert second["input"][0]["type"] == "additional_tools"
    assert any(i["type"] == "custom_tool_call" for i in second["input"])
    fields = prefix(posts[1])
    assert "break" not in fields and fields["repaired"] == "0", fields
    assert matched(posts[1]) == view_elements(second) - 1  # all but the new custom_tool_call_output
    # Its transcript (opaque items and all) reads back whole and writes the same bytes.
    (session,) = (await get_json(proxy, "/kvwarm/sessions"))["data"]
    async with aiohttp.ClientSession() as s, s.get(proxy.make_url(f"/kvwarm/sessions/{session['id']}.md")) as r:
        text = await r.read()
    transcript = transcript_md.parse(text, Policy())
    assert transcript_md.render(transcript).encode() == text
    assert {"additional_tools", "custom_tool_call"} <= {n.role for n in transcript.nodes}


@pytest.mark.usefixtures("agents_sdk")
async def test_openai_agents_run_is_warm_on_its_second_turn(
    make_sim: Any, make_proxy: ProxyFactory, recording: Recorder
) -> None:
    sim = await make_sim(cache_mode="vllm")  # the agent's instructions are short: a block cache shows the reuse
    proxy = await make_proxy(sim)
    hop = await recording(proxy)

    run = await run_agent(str(hop.server.make_url("/v1")), ["What is the weather in Paris?", "And in Oslo?"])
    # The reference upstream calls the tool on each user turn (with its sample city), then answers.
    assert len(run.tool_calls) == 2 and len(run.outputs) == 2
    posts = [e for e in hop.exchanges if e.path == "/v1/responses"]
    assert len(posts) == 4  # per turn: the request answered with a call, the one carrying its output
    bodies = [orjson.loads(e.request) for e in posts]
    outputs = [i["output"] for i in bodies[1]["input"] if i.get("type") == "function_call_output"]
    assert outputs == [weather_report(run.tool_calls[0]["city"])]

    turn2 = posts[2]
    fields = prefix(turn2)
    assert "break" not in fields and fields["repaired"] == "0", fields
    assert matched(turn2) == view_elements(bodies[2]) - 1  # everything but the new user message
    usage = orjson.loads(turn2.response)["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] > 0.8 * usage["input_tokens"]
    assert [r.body for r in received(sim)] == [e.request for e in posts]
