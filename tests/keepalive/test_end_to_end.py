"""The keep-alive end to end: agent sessions (the openai SDK) through kvwarm to the reference
upstream in its breakpoint modes, kvwarm's clock and the upstream's moved together.

A tenant's first sessions teach kvwarm how long they pause; then a paused session's prefix is
re-read shortly before it would expire, and the session's next turn reads it instead of writing
it again. What a ping is not: a turn (nothing in the transcript, in ``kvwarm sessions``, in the
request metrics), a move of the session (it goes to the replica that served the session), a
retry, or anyone's error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.appkeys import PIPELINE
from proxy.keepalive.keeper import USER_AGENT
from proxy.sim.accounting import READ_PRICE, WRITE_PRICE
from proxy.web.view import fmt_usd
from tests.keepalive.conftest import (
    INPUT,
    MODEL,
    OUTPUT,
    SYSTEM,
    PairFactory,
    Session,
    body_of,
    cached,
    learn,
    written,
)
from tests.sim.conftest import WEATHER_TOOL

ClientFactory = Callable[..., openai.AsyncOpenAI]
PAUSE = 360.0
"""Six minutes: longer than a 5-minute TTL, shorter than two."""


def tool(i: int) -> dict[str, Any]:
    """A tool of project ``i`` (projects share no tools: no prefix stem across them)."""
    return {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "description": f"Project {i}'s weather."}}


def sample(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def outcome(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sample(metrics, "kvwarm_keepalive_requests_total", outcome=name)


@pytest.mark.timeout(60)
async def test_a_ping_before_expiry_keeps_the_prefix_for_the_returning_turn(
    make_pair: PairFactory, openai_client: ClientFactory
) -> None:
    pair = await make_pair("anthropic")
    client = openai_client(pair.kvwarm, api_key="sk-alice")
    await learn(pair, client, PAUSE)
    before = len(pair.pings())
    listed = await pair.sessions()
    start = await pair.metrics()

    session = Session(client, "alice")
    first = await session.turn()
    prefix = cached(first) + written(first)
    assert prefix > 2000
    await pair.advance(260)
    assert len(pair.pings()) == before
    await pair.advance(15)  # the ping falls due 30 s before the prefix would expire, at 4.5 minutes
    pings = pair.pings()[before:]
    assert len(pings) == 1
    ping = body_of(pings[0])
    assert ping["max_tokens"] == 1 and "stream" not in ping
    assert ping["messages"] == body_of(pair.turns()[-1])["messages"]  # the prefix as it went, markers included
    assert pings[0].headers["authorization"] == "Bearer sk-alice"

    await pair.advance(PAUSE - 275)  # six minutes after the first turn: expired, but for the ping
    second = await session.turn()
    assert cached(second) == prefix  # read, not written again
    assert written(second) < prefix / 10

    # Nothing of the ping is a turn: the session has its two turns, the store only theirs.
    now_listed = await pair.sessions()
    assert len(now_listed) == len(listed) + 1
    mine = next(s for s in now_listed if s not in listed)
    assert mine["turns"] == 2
    assert mine["prompt_tokens"] == first["prompt_tokens"] + second["prompt_tokens"]

    # The ping and its cost, on /metrics: what it read, the few tokens after the marker, its output.
    end = await pair.metrics()

    def grew(name: str, **labels: str) -> float:
        return sample(end, name, **labels) - sample(start, name, **labels)

    assert outcome(end, "sent") == len(pair.pings())
    assert grew("kvwarm_keepalive_requests_total", outcome="sent") == 1
    assert grew("kvwarm_keepalive_tokens_total", kind="cached") == prefix
    assert grew("kvwarm_keepalive_tokens_total", kind="written") == 0
    uncached = grew("kvwarm_keepalive_tokens_total", kind="uncached")
    output = grew("kvwarm_keepalive_tokens_total", kind="output")
    assert 0 < uncached < 20 and output > 0
    cost = (prefix * READ_PRICE * INPUT + uncached * INPUT + output * OUTPUT) / 1e6
    assert grew("kvwarm_cost_usd_total", model=MODEL, source="keepalive") == pytest.approx(cost)
    saved = prefix * (WRITE_PRICE - READ_PRICE) * INPUT / 1e6
    assert grew("kvwarm_keepalive_saved_usd_total") == pytest.approx(saved)
    assert grew("kvwarm_keepalive_lost_usd_total") == 0
    metrics = end
    # The live page's card: today's pings, their cost, and the writes they avoided less it.
    text = (await pair.overview())["view"]["text"]
    total_cost = sample(end, "kvwarm_cost_usd_total", model=MODEL, source="keepalive")
    total_saved = sample(end, "kvwarm_keepalive_saved_usd_total")
    assert text["keepalive_pings"] == f"{len(pair.pings())} pings cost {fmt_usd(total_cost)}"
    assert text["keepalive_net"] == fmt_usd(total_saved - total_cost)
    assert f"keep-alive {fmt_usd(total_cost)}" in text["cost_split"]
    # The request series count the client's turns only.
    assert sample(metrics, "kvwarm_requests_total", model=MODEL, status="2xx", stream="false") == len(pair.turns())


@pytest.mark.timeout(60)
async def test_no_ping_for_a_tenant_whose_sessions_never_come_back(
    make_pair: PairFactory, openai_client: ClientFactory
) -> None:
    pair = await make_pair("anthropic")
    client = openai_client(pair.kvwarm, api_key="sk-bob")
    await learn(pair, client, PAUSE, sessions=4, back=False)
    session = Session(client, "bob")
    await session.turn()
    await pair.advance(275)
    await pair.advance(3600)
    assert pair.pings() == []
    metrics = await pair.metrics()
    assert outcome(metrics, "skipped_unprofitable") >= 5
    assert outcome(metrics, "sent") == 0
    assert sample(metrics, "kvwarm_cost_usd_total", model=MODEL, source="keepalive") == 0


@pytest.mark.timeout(60)
async def test_no_ping_for_a_prefix_that_cannot_repay_it(make_pair: PairFactory, openai_client: ClientFactory) -> None:
    """A session whose prompt is below the provider's 1,024-token minimum has nothing cached:
    nothing to keep, whatever its tenant's history."""
    pair = await make_pair("anthropic")
    client = openai_client(pair.kvwarm, api_key="sk-carol")
    await learn(pair, client, PAUSE)
    before = len(pair.pings())
    response = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello."}])
    assert response.usage is not None and response.usage.prompt_tokens < 1024
    await pair.advance(275)
    await pair.advance(300)
    assert len(pair.pings()) == before


@pytest.mark.timeout(60)
async def test_the_budget_is_never_exceeded(make_pair: PairFactory, openai_client: ClientFactory) -> None:
    """Each ping's worst case (its prefix written again: about $0.009 here) must fit before it
    goes, and its cost (about $0.001: a read) is what stays spent: $0.0105 a day buys two."""
    pair = await make_pair("anthropic", keepalive__budget_usd_per_day=0.0105)
    client = openai_client(pair.kvwarm, api_key="sk-dave")
    await learn(pair, client, PAUSE)
    for i in range(3):
        session = Session(client, f"dave {i}")
        await session.turn()
        await pair.advance(275)
        await pair.advance(85)
        await session.turn()
    metrics = await pair.metrics()
    spent = sample(metrics, "kvwarm_cost_usd_total", model=MODEL, source="keepalive")
    assert 0 < spent <= 0.0105
    assert outcome(metrics, "sent") == len(pair.pings()) == 2
    assert outcome(metrics, "budget_exhausted") >= 1


@pytest.mark.timeout(60)
async def test_the_longest_keepalive_is_respected(make_pair: PairFactory, openai_client: ClientFactory) -> None:
    """Sessions that come back after 13 minutes and 20 seconds need two pings (at 4.5 and 9
    minutes: the prefix kept to 14); with ``max_session_seconds`` at 10 minutes both go, the third
    due (13.5 minutes) does not, and the session's pings end."""
    pair = await make_pair("anthropic", keepalive__max_session_seconds=600.0)
    client = openai_client(pair.kvwarm, api_key="sk-erin")
    await learn(pair, client, 800.0, sessions=4)
    before = len(pair.pings())
    before_max_age = outcome(await pair.metrics(), "max_age")
    session = Session(client, "erin")
    await session.turn()
    for _ in range(4):
        await pair.advance(270)  # the pings fall due every 4.5 minutes: 270, 540, then 810 > 600
    assert len(pair.pings()) - before == 2
    assert outcome(await pair.metrics(), "max_age") == before_max_age + 1


@pytest.mark.timeout(60)
async def test_each_ping_goes_to_the_replica_that_served_its_session(
    make_pair: PairFactory, openai_client: ClientFactory
) -> None:
    """A pool of three: each session's ping goes where its turn went, and its next turn goes home
    and reads there (the ping moved nothing: no routing decision was made for it)."""
    pair = await make_pair("anthropic", replicas=3, store__secret="a fixed secret: the same placement every run")
    client = openai_client(pair.kvwarm, api_key="sk-pool")
    await learn(pair, client, PAUSE, sessions=3)
    sessions: list[Session] = []
    home: dict[str, TestServer] = {}
    while len(sessions) < 6 or len(set(map(id, home.values()))) < 2:  # placement hashes the replicas' ports
        assert len(sessions) < 12, "the sessions never spread over the pool"
        session = Session(client, f"pool {len(sessions)}:", system=f"Project {len(sessions)}. {SYSTEM}", tools=[tool(len(sessions))])
        await session.turn()
        sessions.append(session)
        home[session.name] = next(s for s in pair.sims if any(session.name.encode() in r.body for r in pair.turns(s)))
    before = {id(s): len(pair.pings(s)) for s in pair.sims}
    decisions = await pair.metrics()
    await pair.advance(275)
    for session in sessions:
        sim = home[session.name]
        pinged = [r for r in pair.pings(sim)[before[id(sim)] :] if session.name.encode() in r.body]
        assert len(pinged) == 1
        assert not any(session.name.encode() in r.body for other in pair.sims if other is not sim for r in pair.pings(other))
    after = await pair.metrics()
    kinds = [key for key in after if key[0] == "kvwarm_routing_decisions_total"]
    assert all(after[k] == decisions.get(k, 0.0) for k in kinds)
    await pair.advance(85)
    for session in sessions:
        usage = await session.turn()
        assert cached(usage) == cached(session.usages[0]) + written(session.usages[0])


@pytest.mark.timeout(60)
async def test_a_streamed_session_gets_a_plain_ping(make_pair: PairFactory, openai_client: ClientFactory) -> None:
    pair = await make_pair("anthropic")
    client = openai_client(pair.kvwarm, api_key="sk-frank")
    await learn(pair, client, PAUSE)
    before = len(pair.pings())
    session = Session(client, "frank")
    first = await session.streamed_turn()
    await pair.advance(275)
    (ping,) = pair.pings()[before:]
    body = body_of(ping)
    assert "stream" not in body and "stream_options" not in body and body["max_tokens"] == 1
    assert ping.headers["user-agent"] == USER_AGENT
    await pair.advance(85)
    second = await session.turn()
    assert cached(second) == cached(first) + written(first)


@pytest.mark.timeout(60)
async def test_a_failed_ping_costs_only_itself(make_pair: PairFactory, openai_client: ClientFactory) -> None:
    """The upstream goes away while the session pauses: the ping fails once (no retry, no error
    to anyone, the replica not ejected), and the session's pings end."""
    pair = await make_pair("anthropic")
    client = openai_client(pair.kvwarm, api_key="sk-gina")
    await learn(pair, client, PAUSE)
    session = Session(client, "gina")
    await session.turn()
    await pair.sim.close()
    await pair.advance(275)
    await pair.advance(270)
    metrics = await pair.metrics()
    assert outcome(metrics, "failed") == 1
    assert sum(v for (name, _), v in metrics.items() if name == "kvwarm_upstream_ejections_total") == 0
    assert sample(metrics, "kvwarm_errors_total", stage="keepalive") == 0
    (watch,) = [w for w in pair.keeper.watches.values() if w.pings == 0 and not w.active]
    assert watch.headers is None and watch.raw == b"" and watch.replica is None  # the credential dropped


@pytest.mark.timeout(60)
async def test_openai_breakpoints_keep_a_30_minute_prefix(make_pair: PairFactory, openai_client: ClientFactory) -> None:
    """OpenAI's explicit breakpoints live 30 minutes: a session back after 35 gets one ping at
    29.5 minutes and reads its prefix."""
    pair = await make_pair("openai-breakpoints")
    client = openai_client(pair.kvwarm, api_key="sk-hank")
    await learn(pair, client, 2100.0)
    before = len(pair.pings())
    session = Session(client, "hank")
    first = await session.turn()
    await pair.advance(1700)
    assert len(pair.pings()) == before
    await pair.advance(75)
    (ping,) = pair.pings()[before:]
    assert body_of(ping)["max_completion_tokens"] == 1
    await pair.advance(325)
    second = await session.turn()
    assert cached(second) == cached(first) + written(first) > 2000


@pytest.mark.timeout(60)
async def test_a_responses_session_is_kept(make_pair: PairFactory, openai_client: ClientFactory) -> None:
    pair = await make_pair("openai-breakpoints")
    client = openai_client(pair.kvwarm, api_key="sk-iris")

    async def task(name: str, pause: float) -> list[Any]:
        items: list[Any] = [
            {"type": "message", "role": "developer", "content": Session(client, name).messages[0]["content"]},
            {"type": "message", "role": "user", "content": f"{name}: fix the bug."},
        ]
        usages = []
        for round_ in range(2):
            response = await client.responses.create(model=MODEL, input=items, store=False)
            assert response.usage is not None
            usages.append(response.usage.model_dump())
            items += [item.model_dump(exclude_none=True) for item in response.output]
            items.append({"type": "message", "role": "user", "content": f"{name}: and round {round_}."})
            if round_ == 0:
                await pair.advance(pause)
        return usages

    for i in range(3):
        await task(f"warm-up {i}", 2100.0)
        await pair.advance(3 * 3600.0)
    before = len(pair.pings())
    usages = await task("iris", 2100.0)
    (ping,) = pair.pings()[before:]
    body = body_of(ping)
    assert body["max_output_tokens"] == 16 and body["store"] is False
    assert ping.path.endswith("/responses")
    assert cached(usages[1]) == cached(usages[0]) + written(usages[0]) > 2000



@pytest.mark.timeout(60)
async def test_at_shutdown_the_task_is_awaited_and_every_credential_dropped(
    make_pair: PairFactory, openai_client: ClientFactory
) -> None:
    pair = await make_pair("anthropic")
    session = Session(openai_client(pair.kvwarm, api_key="sk-jane"), "jane")
    await session.turn()
    keeper = pair.keeper
    (watch,) = keeper.watches.values()
    assert watch.active and dict(watch.headers or ())["Authorization"] == "Bearer sk-jane"
    tasks = [t for t in asyncio.all_tasks() if t.get_name() == "kvwarm-keepalive"]
    assert len(tasks) == 1
    await pair.kvwarm.close()
    assert tasks[0].done()
    assert not keeper.watches and not watch.active and watch.raw == b"" and watch.replica is None
    assert pair.kvwarm.app[PIPELINE].keepalive is None
