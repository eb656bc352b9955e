"""Per-session totals kept with the session in the store, and the per-request INFO log line.

Source of truth: the usage blocks the client received from the reference
upstream (JSON bodies, relayed unchanged), costs computed here from them and
the price table (or the upstream's own ``openhuman`` bill).
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from typing import Any

import orjson
import pytest

from tests.agents import Agent, Drift, Turn, args_python_dumps, no_drift, varying
from tests.conftest import ProxyFactory, store_of
from tests.proxy.test_usage_metrics import (
    BILLING,
    SIM_MODEL,
    SimFactory,
    cached_of,
    chat,
    estimated_usd,
    poster,
    prefix_header,
)


def sums(responses: list[dict[str, Any]], billed: bool = False) -> dict[str, Any]:
    """The totals a session of these responses must hold, from the upstream's own reports."""
    usages = [r["usage"] for r in responses]
    cost = sum(r["openhuman"]["billing"]["charged_amount_usd"] for r in responses) if billed else sum(estimated_usd(u) for u in usages)
    return {
        "turns": len(responses),
        "prompt_tokens": sum(u["prompt_tokens"] for u in usages),
        "cached_tokens": sum(cached_of(u) for u in usages),
        "completion_tokens": sum(u["completion_tokens"] for u in usages),
        "unknown_cache_turns": 0,
        "cost_usd": pytest.approx(cost, rel=1e-9),
        "billed": billed,
    }


def totals_of(info: Any) -> dict[str, Any]:
    t = info.totals
    return {k: getattr(t, k) for k in ("turns", "prompt_tokens", "cached_tokens", "completion_tokens", "unknown_cache_turns", "cost_usd", "billed")}


def repaired(turns: list[Turn]) -> int:
    return sum(int(prefix_header(t.response)["repaired"]) for t in turns)


def first_user_text(store: Any, leaf: bytes) -> str:
    path = store.path(leaf)
    assert path, "a session's path must be whole"
    return next(orjson.loads(n.body)["content"] for n in path if n.role == "user")


@pytest.mark.parametrize(
    ("drift", "openhuman"), [(no_drift, False), (varying, True)], ids=["plain", "drift-billed"]
)
async def test_four_turn_conversation_is_one_session_with_the_sums(
    make_sim: SimFactory, make_proxy: ProxyFactory, drift: Drift, openhuman: bool
) -> None:
    config: dict[str, Any] = {"openhuman": True, **BILLING} if openhuman else {}
    kvwarm = await make_proxy(await make_sim(**config))
    agent = Agent(poster(kvwarm), drift=drift)
    await agent.run(4)
    responses = [t.response for t in agent.turns]

    sessions = store_of(kvwarm).sessions()
    assert len(sessions) == 1
    (session,) = sessions
    assert totals_of(session) == sums(responses, billed=openhuman)
    assert session.totals.cached_tokens > 0
    assert session.totals.repaired == repaired(agent.turns)
    assert (session.totals.repaired > 0) is (drift is not no_drift)
    assert session.totals.last_break == ""
    assert session.totals.model == SIM_MODEL
    # The session ends at the last reply: its path is the whole conversation.
    assert len(store_of(kvwarm).path(session.leaf)) == 1 + len(agent.turns[-1].request["messages"]) + 1


async def test_parallel_conversations_are_two_sessions(make_sim: SimFactory, make_proxy: ProxyFactory) -> None:
    kvwarm = await make_proxy(await make_sim())
    texts = ["Find where the cache key is computed and explain it.", "List the public functions of the store module."]
    agents = [Agent(poster(kvwarm)) for _ in texts]
    for agent, text in zip(agents, texts, strict=True):
        agent.history[1]["content"] = text  # same system prompt and tools, different user
    for _ in range(4):
        await asyncio.gather(*(a.step() for a in agents))

    store = store_of(kvwarm)
    sessions = store.sessions()
    assert len(sessions) == 2
    by_text = {first_user_text(store, s.leaf): s for s in sessions}
    assert set(by_text) == set(texts)
    for agent, text in zip(agents, texts, strict=True):
        assert totals_of(by_text[text]) == sums([t.response for t in agent.turns])


async def test_fork_from_the_middle_does_not_double_count(make_sim: SimFactory, make_proxy: ProxyFactory) -> None:
    kvwarm = await make_proxy(await make_sim())
    agent = Agent(poster(kvwarm))
    await agent.run(4)
    store = store_of(kvwarm)
    (main_before,) = store.sessions()

    # Back to turn 2's reply, then another question: a new branch sharing the first turns.
    upto = len(agent.turns[1].request["messages"]) + 1
    fork_text = "Forget that; show me the git log instead."
    fork = {"model": SIM_MODEL, "messages": [*agent.history[:upto], {"role": "user", "content": fork_text}], "tools": agent.tools}
    response = await poster(kvwarm)(fork)
    assert response["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "the fork shares the upstream's cached prefix"

    sessions = store.sessions()
    assert len(sessions) == 2
    main = next(s for s in sessions if s.leaf == main_before.leaf)
    forked = next(s for s in sessions if s.leaf != main_before.leaf)
    assert totals_of(main) == sums([t.response for t in agent.turns])
    assert totals_of(forked) == sums([response])
    assert orjson.loads(store.path(forked.leaf)[-2].body)["content"] == fork_text
    # All sessions together: exactly the five exchanges the upstream reported.
    everything = sums([t.response for t in agent.turns] + [response])
    for key in ("turns", "prompt_tokens", "cached_tokens", "completion_tokens"):
        assert sum(getattr(s.totals, key) for s in sessions) == everything[key], key
    assert sum(s.totals.cost_usd for s in sessions) == everything["cost_usd"]


async def test_a_break_is_kept_with_its_session(make_sim: SimFactory, make_proxy: ProxyFactory) -> None:
    kvwarm = await make_proxy(await make_sim())
    agent = Agent(poster(kvwarm))
    await agent.run(2)
    # The user edits the earlier question and goes on from there for two turns.
    edited = Agent(poster(kvwarm))
    edited.history = agent.next_request()["messages"]
    edited.history[1]["content"] += " Only the first match."
    edited.sent = len(edited.history) - 1
    await edited.run(2)
    assert prefix_header(edited.turns[0].response)["break"] == "content_changed@1"
    assert "break" not in prefix_header(edited.turns[1].response), "a new turn is not a break"

    store = store_of(kvwarm)
    sessions = store.sessions()
    assert len(sessions) == 2
    branch = next(s for s in sessions if first_user_text(store, s.leaf) == edited.history[1]["content"])
    original = next(s for s in sessions if s is not branch)
    assert totals_of(branch) == sums([t.response for t in edited.turns])
    assert totals_of(original) == sums([t.response for t in agent.turns])
    # The session's last break is the edit, not the ordinary turn that followed it; none for the original.
    assert branch.totals.last_break == "content_changed"
    assert original.totals.last_break == ""


# -- the INFO line of each request --------------------------------------------------------------

_FIELD = re.compile(r"(\w+)=(\S+)")


async def test_info_log_line_has_the_numbers_and_no_secrets(
    make_sim: SimFactory, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)  # every logger, so a leak anywhere is caught
    marker = f"zebra-{uuid.uuid4().hex}"
    client_key = f"sk-client-{uuid.uuid4().hex}"
    upstream_key = f"sk-upstream-{uuid.uuid4().hex}"
    kvwarm = await make_proxy(await make_sim(), upstream__api_key=upstream_key)

    agent = Agent(poster(kvwarm, key=client_key), drift=args_python_dumps)
    agent.history[1]["content"] = f"Find {marker} in the code base."
    await agent.run(3)
    responses = [t.response for t in agent.turns]
    edited = agent.next_request()
    edited["messages"][1]["content"] += f" Also {marker}-2."
    responses.append(await poster(kvwarm, key=client_key)(edited))
    failed = await chat(kvwarm, agent.next_request(), client_key, **{"x-sim-fault": "status=503"})
    assert failed["_status"] == 503
    responses.append(failed)

    lines = [r for r in caplog.records if r.name == "proxy.request.pipeline" and r.levelno == logging.INFO]
    assert len(lines) == len(responses)
    for record, response in zip(lines, responses, strict=True):
        fields = dict(_FIELD.findall(record.getMessage()))
        assert fields["model"] == SIM_MODEL
        assert fields["status"] == str(response["_status"])
        assert float(fields["duration"].rstrip("s")) > 0
        header = prefix_header(response)
        assert int(fields["repaired"]) == int(header["repaired"])
        if "break" in header:
            assert fields["break"] == header["break"].split("@")[0]
        else:
            assert fields["break"] in ("-", "new_branch")
        usage = response.get("usage") if response["_status"] == 200 else None
        if usage is None:
            assert fields["prompt"] == fields["cached"] == "None"
            assert fields["hit"] == fields["cost"] == "?"
            continue
        prompt, cached = usage["prompt_tokens"], cached_of(usage)
        assert (int(fields["prompt"]), int(fields["cached"])) == (prompt, cached)
        assert float(fields["hit"].rstrip("%")) == pytest.approx(100 * cached / prompt, abs=0.05)
        assert fields["cost"].startswith("$") and fields["cost"].endswith("~")  # estimated, not billed
        assert float(fields["cost"].strip("$~")) == pytest.approx(estimated_usd(usage), abs=1e-6)
    assert sum(int(dict(_FIELD.findall(r.getMessage()))["repaired"]) for r in lines) > 0
    assert any("break=content_changed" in r.getMessage() for r in lines)

    assert caplog.records
    for record in caplog.records:
        text = record.getMessage() + (record.exc_text or "")
        for secret in (marker, client_key, upstream_key):
            assert secret not in text, (record.name, record.levelname)
    for secret in (marker, client_key, upstream_key):
        assert secret not in caplog.text
