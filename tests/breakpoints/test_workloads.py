"""Cache breakpoints end to end: the official openai SDK, direct and through kvwarm, to the
reference upstream in its breakpoint modes (proxy/sim/markers.py), which reports and bills
cache reads and writes.

Every workload (tests/breakpoints/workloads.py, which the benchmark runs too) runs against a
fresh upstream per route, so the routes never share a cache; each is measured from the usage the
upstream returned to the client, billed as the upstream bills it (proxy/sim/accounting.py: a read
0.1 x input, a write 1.25 x). Markers render no token: every request's ``prompt_tokens`` is the
same direct and through kvwarm.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.sim.accounting import READ_PRICE, WRITE_PRICE
from proxy.sim.markers import ANTHROPIC, OPENAI_BREAKPOINTS
from proxy.sim.state import SimConfig
from tests.breakpoints.workloads import (
    CC,
    INPUT,
    MODEL,
    SYSTEM,
    TOOLS,
    Ledger,
    agent,
    ask,
    marked_last,
    single_shot_tasks,
)
from tests.conftest import ProxyFactory, metric, received

SimFactory = Callable[..., Awaitable[TestServer]]
ClientFactory = Callable[..., openai.AsyncOpenAI]


async def routes(make_sim: SimFactory, make_proxy: ProxyFactory, mode: str, setting: str, **overrides: Any) -> tuple[TestServer, TestServer, TestServer]:
    """A fresh upstream for direct requests, and another behind kvwarm."""
    direct = await make_sim(cache_mode=mode)
    behind = await make_sim(cache_mode=mode)
    proxy = await make_proxy(behind, upstream__cache_breakpoints=setting, **overrides)
    return direct, behind, proxy


@pytest.mark.timeout(60)
async def test_single_shot_tasks_share_the_system_prompt_only_through_kvwarm(
    make_sim: SimFactory, make_proxy: ProxyFactory, openai_client: ClientFactory, tmp_path: Path
) -> None:
    """openai/codex#35300: single-shot tasks sharing a long system prompt get no hits under the
    implicit breakpoint alone; through kvwarm every task after the first reads the system prompt."""
    direct_sim, behind, proxy = await routes(
        make_sim, make_proxy, OPENAI_BREAKPOINTS, "openai", metrics__prices_file=str(prices(tmp_path))
    )
    direct, through = Ledger(OPENAI_BREAKPOINTS), Ledger(OPENAI_BREAKPOINTS)
    for messages in single_shot_tasks(8):
        await ask(openai_client(direct_sim), direct, messages)
        await ask(openai_client(proxy), through, messages)
    print("\n" + direct.line("single-shot direct") + "\n" + through.line("single-shot kvwarm"))
    assert through.prompts == direct.prompts  # markers render no token
    assert sum(direct.cached) == 0
    assert through.cached[0] == 0 and all(c >= 1900 for c in through.cached[1:])
    assert through.share > 0.8
    assert through.usd < 0.3 * direct.usd
    # What the markers earned, counted apart: every read needed kvwarm's head marker.
    saved = sum(through.cached) * INPUT * (1 - READ_PRICE) / 1e6
    assert metric(proxy, "kvwarm_cache_savings_usd_total", model=MODEL, by="breakpoint") == pytest.approx(saved)
    assert metric(proxy, "kvwarm_cache_savings_usd_total", model=MODEL, by="cache") == 0
    # The first task's system prompt, written with its implicit breakpoint; then a stem, shared.
    assert metric(proxy, "kvwarm_breakpoints_total", dialect="openai", kind="head") == 1
    assert metric(proxy, "kvwarm_breakpoints_total", dialect="openai", kind="stem") == 7
    sent = [orjson.loads(r.body) for r in received(behind)]
    assert all(s["messages"][0]["content"][0]["prompt_cache_breakpoint"] == {"mode": "explicit"} for s in sent)
    raw = await openai_client(proxy).chat.completions.with_raw_response.create(model=MODEL, messages=single_shot_tasks(9)[8])
    assert raw.headers["x-kvwarm-prefix"] == "matched=1/2; repaired=0; breakpoints=1"


@pytest.mark.timeout(60)
async def test_single_shot_tasks_on_an_anthropic_style_upstream(
    make_sim: SimFactory, make_proxy: ProxyFactory, openai_client: ClientFactory
) -> None:
    """Without markers nothing is cached. kvwarm marks the system prompt once two tasks shared it
    (the first task writes nothing: a boundary seen once is not worth a write), and never writes
    a task's own tail, which no later task reads (the static policy writes it every time)."""
    bare_sim, _, proxy = await routes(make_sim, make_proxy, ANTHROPIC, "cache_control")
    static_sim = await make_sim(cache_mode=ANTHROPIC)
    bare, static, through = Ledger(ANTHROPIC), Ledger(ANTHROPIC), Ledger(ANTHROPIC)
    for messages in single_shot_tasks(8):
        await ask(openai_client(bare_sim), bare, messages)
        await ask(openai_client(static_sim), static, marked_last(messages))
        await ask(openai_client(proxy), through, messages)
    print("\n" + "\n".join(x.line(n) for x, n in ((bare, "single-shot cc direct"), (static, "single-shot cc static"), (through, "single-shot cc kvwarm"))))
    assert through.prompts == bare.prompts
    assert through.cached[:2] == [0, 0] and all(c >= 1900 for c in through.cached[2:])
    assert sum(through.written) == through.written[1] < sum(static.written)
    assert through.usd < 0.5 * bare.usd


@pytest.mark.timeout(60)
async def test_a_prefix_seen_once_is_never_written(
    make_sim: SimFactory, make_proxy: ProxyFactory, openai_client: ClientFactory
) -> None:
    """System prompts that differ on every request (a date, a user's name, retrieved documents):
    the static policy pays the write premium on each and reads none; kvwarm marks nothing."""
    bare_sim, _, proxy = await routes(make_sim, make_proxy, ANTHROPIC, "cache_control")
    static_sim = await make_sim(cache_mode=ANTHROPIC)
    bare, static, through = Ledger(ANTHROPIC), Ledger(ANTHROPIC), Ledger(ANTHROPIC)
    for i in range(6):
        messages = [{"role": "system", "content": f"Request {i}. {SYSTEM}"}, {"role": "user", "content": "Summarise."}]
        await ask(openai_client(bare_sim), bare, messages)
        await ask(openai_client(static_sim), static, marked_last(messages))
        await ask(openai_client(proxy), through, messages)
    print("\n" + "\n".join(x.line(n) for x, n in ((bare, "unique prefix direct"), (static, "unique prefix static"), (through, "unique prefix kvwarm"))))
    assert sum(through.written) == sum(through.cached) == 0
    assert through.usd == pytest.approx(bare.usd)
    assert static.usd > 1.2 * bare.usd


@pytest.mark.timeout(60)
async def test_multi_turn_sessions_cost_no_more_than_direct(
    make_sim: SimFactory, make_proxy: ProxyFactory, openai_client: ClientFactory
) -> None:
    direct_sim, _, proxy = await routes(make_sim, make_proxy, OPENAI_BREAKPOINTS, "openai")
    direct, through = Ledger(OPENAI_BREAKPOINTS), Ledger(OPENAI_BREAKPOINTS)
    for name in ("alpha", "beta", "gamma"):
        await agent(openai_client(direct_sim), direct, name)
        await agent(openai_client(proxy), through, name)
    print("\n" + direct.line("multi-turn direct") + "\n" + through.line("multi-turn kvwarm"))
    assert through.prompts == direct.prompts
    assert through.usd <= direct.usd
    assert sum(through.cached) >= sum(direct.cached)


@pytest.mark.timeout(60)
async def test_a_markerless_agent_gets_at_least_the_static_policy(
    make_sim: SimFactory, make_proxy: ProxyFactory, openai_client: ClientFactory, tmp_path: Path
) -> None:
    """On an Anthropic-style upstream a marker-less agent caches nothing; through kvwarm it gets
    at least what a client marking its system prompt and latest message every turn gets, at no
    higher cost (more: the long turn's previous-turn marker)."""
    bare_sim = await make_sim(cache_mode=ANTHROPIC)
    static_sim = await make_sim(cache_mode=ANTHROPIC)
    behind = await make_sim(cache_mode=ANTHROPIC)
    proxy = await make_proxy(behind, upstream__cache_breakpoints="cache_control", metrics__prices_file=str(prices(tmp_path)))
    bare, static, through = Ledger(ANTHROPIC), Ledger(ANTHROPIC), Ledger(ANTHROPIC)
    for name in ("alpha", "beta", "gamma"):
        await agent(openai_client(bare_sim), bare, name)
        await agent(openai_client(static_sim), static, name, static=True)
        await agent(openai_client(proxy), through, name)
    print("\n" + "\n".join(x.line(n) for x, n in ((bare, "agent direct"), (static, "agent static policy"), (through, "agent kvwarm"))))
    assert through.prompts == static.prompts == bare.prompts
    assert sum(bare.cached) == 0
    assert sum(through.cached) >= sum(static.cached)
    assert through.usd <= static.usd
    assert through.usd < 0.5 * bare.usd
    # No client marker: every read and write happened at kvwarm's markers.
    saved = sum(through.cached) * INPUT * (1 - READ_PRICE) / 1e6
    premium = sum(through.written) * INPUT * (WRITE_PRICE - 1) / 1e6
    assert metric(proxy, "kvwarm_cache_savings_usd_total", model=MODEL, by="breakpoint") == pytest.approx(saved)
    assert metric(proxy, "kvwarm_cache_write_premium_usd_total", model=MODEL, by="breakpoint") == pytest.approx(premium)
    assert metric(proxy, "kvwarm_breakpoints_total", dialect="cache_control", kind="previous") == 3
    assert all(len(_markers(r.body)) <= 4 for r in received(behind))


@pytest.mark.timeout(60)
async def test_a_client_moving_its_markers_is_kept_and_no_drift(
    make_sim: SimFactory, make_proxy: ProxyFactory, openai_client: ClientFactory
) -> None:
    """The static-policy client through kvwarm: its markers move every turn. No break, no repair,
    its markers arrive where it put them, kvwarm adds only within the four, and it costs no more."""
    static_sim = await make_sim(cache_mode=ANTHROPIC)
    _, behind, proxy = await routes(make_sim, make_proxy, ANTHROPIC, "cache_control")
    direct, through = Ledger(ANTHROPIC), Ledger(ANTHROPIC)
    for name in ("alpha", "beta"):
        await agent(openai_client(static_sim), direct, name, static=True)
        await agent(openai_client(proxy), through, name, static=True)
    print("\n" + direct.line("static direct") + "\n" + through.line("static kvwarm"))
    assert metric(proxy, "kvwarm_prefix_breaks_total", reason="content_changed") == 0
    assert sum(metric(proxy, "kvwarm_repairs_total", kind=k) for k in ("whitespace", "content_parts", "pinned")) == 0
    assert through.prompts == direct.prompts
    assert through.usd <= direct.usd
    for direct_request, request in zip(received(static_sim), received(behind), strict=True):
        mine, theirs = _markers(request.body), _markers(direct_request.body)
        assert len(mine) <= 4
        assert all(marker in mine for marker in theirs)  # the client's, where it put them


@pytest.mark.timeout(60)
async def test_a_client_already_sending_four_markers_gets_none(
    make_sim: SimFactory, make_proxy: ProxyFactory, openai_client: ClientFactory
) -> None:
    direct_sim, behind, proxy = await routes(make_sim, make_proxy, ANTHROPIC, "cache_control")
    direct, through = Ledger(ANTHROPIC), Ledger(ANTHROPIC)
    parts = [{"type": "text", "text": f"Part {i} of the brief.", "cache_control": CC} for i in range(3)]
    for i in range(4):
        messages = [
            {"role": "system", "content": [{"type": "text", "text": SYSTEM, "cache_control": CC}]},
            {"role": "user", "content": [*parts, {"type": "text", "text": f"Task {i}."}]},
        ]
        await ask(openai_client(direct_sim), direct, messages, tools=TOOLS)
        await ask(openai_client(proxy), through, messages, tools=TOOLS)
    assert [r.body for r in received(behind)] == [r.body for r in received(direct_sim)]
    assert through.cached == direct.cached and through.written == direct.written


@pytest.mark.timeout(60)
async def test_responses_single_shot_tasks(
    make_sim: SimFactory, make_proxy: ProxyFactory, openai_client: ClientFactory
) -> None:
    """The Codex shape: instructions, then a long developer message, then the task."""
    direct_sim, _, proxy = await routes(make_sim, make_proxy, OPENAI_BREAKPOINTS, "openai")
    direct, through = Ledger(OPENAI_BREAKPOINTS), Ledger(OPENAI_BREAKPOINTS)
    for i in range(5):
        request: dict[str, Any] = {
            "model": MODEL,
            "instructions": "You are a coding agent.",
            "input": [
                {"type": "message", "role": "developer", "content": SYSTEM},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"Task {i}."}]},
            ],
            "store": False,
        }
        for client, ledger in ((openai_client(direct_sim), direct), (openai_client(proxy), through)):
            response = await client.responses.create(**request)
            assert response.usage is not None
            ledger.add(response.usage.model_dump())
    print("\n" + direct.line("responses direct") + "\n" + through.line("responses kvwarm"))
    assert through.prompts == direct.prompts
    assert sum(direct.cached) == 0 and through.share > 0.7
    assert through.usd < 0.4 * direct.usd


@pytest.mark.timeout(60)
async def test_session_cache_keys_and_breakpoints_together(
    make_sim: SimFactory, make_proxy: ProxyFactory, openai_client: ClientFactory
) -> None:
    """``routing.prompt_cache_key = "session"``: each request carries its session's key and the
    markers; each session's turns read its previous turn, within its own key."""
    _, behind, proxy = await routes(
        make_sim, make_proxy, OPENAI_BREAKPOINTS, "openai", routing__prompt_cache_key="session"
    )
    through = Ledger(OPENAI_BREAKPOINTS)
    for name in ("alpha", "beta"):
        await agent(openai_client(proxy), through, name, long_turn=False)
    sent = [orjson.loads(r.body) for r in received(behind)]
    assert all(isinstance(s["prompt_cache_key"], str) and _markers(orjson.dumps(s)) for s in sent)
    assert len({s["prompt_cache_key"] for s in sent}) == 2
    assert all(c > 0 for c in through.cached[1:4])  # every later turn of a session reads


def _markers(body: bytes) -> list[bytes]:
    """Every marked object of a request, as JSON (its own form, the marker included)."""
    found: list[bytes] = []
    stack: list[Any] = [orjson.loads(body)]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if "cache_control" in value or "prompt_cache_breakpoint" in value:
                found.append(orjson.dumps(value, option=orjson.OPT_SORT_KEYS))
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return found


def prices(tmp_path: Path) -> Path:
    """A price table that prices ``MODEL`` as the upstream bills it in its breakpoint modes."""
    path = tmp_path / "prices.toml"
    path.write_text(
        f'[models."{MODEL}"]\ninput = {INPUT}\ncached_input = {READ_PRICE * INPUT}\noutput = {SimConfig().price_output}\n'
        f"cache_write_multiplier = {WRITE_PRICE}\n",
        encoding="utf-8",
    )
    return path
