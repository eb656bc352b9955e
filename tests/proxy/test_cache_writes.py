"""Cache writes priced everywhere, end to end: the official openai SDK through kvwarm to the
reference upstream in its breakpoint modes (proxy/sim/markers.py), which report and bill cache
writes.

Every expected number is worked out by hand from the usage the upstream itself returned to the
client, at a price table that says what the upstream bills (reads at 0.1 x input, writes at
1.25 x; proxy/sim/accounting.py), and is checked against the upstream's own bill for the same
usage: kvwarm's ``kvwarm_cache_write_tokens_total`` by TTL, its estimated cost with the write
premium, and what the cache saved (negative after a first turn that only wrote), with the
repairs' share taken from the ``rescued=`` of each response's ``x-kvwarm-prefix`` header.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.sim.accounting import LONG_WRITE_PRICE, READ_PRICE, WRITE_PRICE, Accounting
from proxy.sim.markers import ANTHROPIC, OPENAI_BREAKPOINTS
from proxy.sim.state import SimConfig
from tests.conftest import ProxyFactory, metric
from tests.sim.conftest import WEATHER_TOOL, long_system_prompt

SimFactory = Callable[..., Awaitable[TestServer]]
ClientFactory = Callable[..., openai.AsyncOpenAI]

MODEL = "sim-cache"
SIM = SimConfig()
INPUT, OUTPUT = SIM.price_input, SIM.price_output
READ = READ_PRICE * INPUT
"""USD per million cached tokens, as the upstream bills them."""
STABLE = long_system_prompt(150)
"""About 1950 tokens: a prefix the upstream caches (1024 tokens at least)."""
SEARCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "search", "description": "Search the web.",
                 "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}},
}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]


def price_table(path: Path) -> Path:
    """A price table that prices ``MODEL`` as the upstream bills in its breakpoint modes."""
    path.write_text(
        f'[models."{MODEL}"]\ninput = {INPUT}\ncached_input = {READ}\noutput = {OUTPUT}\n'
        f"cache_write_multiplier = {WRITE_PRICE}\ncache_write_1h_multiplier = {LONG_WRITE_PRICE[ANTHROPIC]}\n"
        f"cache_write_12h_multiplier = {LONG_WRITE_PRICE.get(OPENAI_BREAKPOINTS, WRITE_PRICE)}\n",
        encoding="utf-8",
    )
    return path


@dataclass(frozen=True)
class Turn:
    """One response's usage as the client received it, and what kvwarm rescued on it."""

    prompt: int
    cached: int
    written: int
    completion: int
    long_written: int = 0
    """Of ``written``, those written for the long TTL (only the Responses API says)."""
    rescued: int = 0

    def bill(self, mode: str) -> float:
        """The upstream's own bill for this usage (proxy/sim/accounting.py)."""
        return Accounting(
            prompt_tokens=self.prompt, cached_tokens=self.cached, completion_tokens=self.completion,
            reasoning_tokens=0, cache_write_tokens=self.written, long_write_tokens=self.long_written, cache_mode=mode,
        ).charged(SimConfig(cache_mode=mode))


def by_hand(turns: list[Turn], long_rate: float = WRITE_PRICE * INPUT) -> dict[str, float]:
    """USD cost, reads' saving (and the repairs' share) and write premium, per million tokens
    worked out from the usage numbers."""
    short_rate = WRITE_PRICE * INPUT
    cost = saved = repaired = premium = 0.0
    for t in turns:
        short = t.written - t.long_written
        cost += (t.prompt - t.cached - t.written) * INPUT + t.cached * READ
        cost += short * short_rate + t.long_written * long_rate + t.completion * OUTPUT
        saved += t.cached * (INPUT - READ)
        repaired += min(t.rescued, t.cached) * (INPUT - READ)
        premium += short * (short_rate - INPUT) + t.long_written * (long_rate - INPUT)
    return {k: v / 1e6 for k, v in {"cost": cost, "saved": saved, "repaired": repaired, "premium": premium}.items()}


def rescued(headers: Any) -> int:
    """``rescued=`` of ``x-kvwarm-prefix`` (0 when nothing was repaired)."""
    for part in headers.get("x-kvwarm-prefix", "").split("; "):
        if part.startswith("rescued="):
            return int(part.removeprefix("rescued="))
    return 0


def assert_counted(kvwarm: TestServer, turns: list[Turn], mode: str, written: dict[str, int]) -> None:
    """kvwarm's counters of ``MODEL`` are the hand-computed values of ``turns``."""
    m = {"model": MODEL}
    expected = by_hand(turns)
    assert {ttl: metric(kvwarm, "kvwarm_cache_write_tokens_total", ttl=ttl, **m) for ttl in written} == written
    assert metric(kvwarm, "kvwarm_cached_prompt_tokens_total", **m) == sum(t.cached for t in turns)
    cost = metric(kvwarm, "kvwarm_cost_usd_total", source="estimated", **m)
    assert cost == pytest.approx(expected["cost"], rel=1e-9)
    assert cost == pytest.approx(sum(t.bill(mode) for t in turns), rel=1e-9)  # what the upstream charged
    by = {b: metric(kvwarm, "kvwarm_cache_savings_usd_total", by=b, **m) for b in ("cache", "repair")}
    assert by["repair"] == pytest.approx(expected["repaired"], rel=1e-9, abs=1e-15)
    assert by["cache"] + by["repair"] == pytest.approx(expected["saved"], rel=1e-9, abs=1e-15)
    premium = metric(kvwarm, "kvwarm_cache_write_premium_usd_total", by="cache", **m)
    assert premium == pytest.approx(expected["premium"], rel=1e-9)


# -- anthropic: cache_control markers, as OpenRouter and DashScope take them on chat ---------------


EPHEMERAL: dict[str, Any] = {"type": "ephemeral"}


def system() -> dict[str, Any]:
    return {"role": "system", "content": [{"type": "text", "text": STABLE, "cache_control": EPHEMERAL}]}


def marked_user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text, "cache_control": EPHEMERAL}]}


async def chat_turn(client: openai.AsyncOpenAI, messages: list[Any], tools: list[Any], *, stream: bool) -> tuple[Turn, str]:
    """One chat completion through kvwarm: its usage as a :class:`Turn`, and the reply."""
    create = client.chat.completions.with_raw_response.create
    if stream:
        raw = await create(model=MODEL, messages=messages, tools=tools, stream=True,
                           stream_options={"include_usage": True})
        chunks = [chunk async for chunk in raw.parse()]
        usage = next(c.usage for c in chunks if c.usage is not None)
        reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        raw = await create(model=MODEL, messages=messages, tools=tools)
        completion = raw.parse()
        usage, reply = completion.usage, completion.choices[0].message.content or ""
    assert usage is not None and usage.prompt_tokens_details is not None
    details = usage.prompt_tokens_details
    assert details.cached_tokens is not None and details.cache_write_tokens is not None
    turn = Turn(usage.prompt_tokens, details.cached_tokens, details.cache_write_tokens, usage.completion_tokens,
                rescued=rescued(raw.headers))
    return turn, reply


@pytest.mark.parametrize("anthropic_usage", [False, True], ids=["openrouter-usage", "anthropic-fields"])
async def test_anthropic_markers_writes_reads_cost_and_savings(
    make_sim: SimFactory, make_proxy: ProxyFactory, openai_client: ClientFactory, tmp_path: Path,
    anthropic_usage: bool,
) -> None:
    sim = await make_sim(cache_mode=ANTHROPIC, anthropic_usage=anthropic_usage)
    kvwarm = await make_proxy(sim, metrics__prices_file=str(price_table(tmp_path / "prices.toml")))
    client = openai_client(kvwarm)

    messages: list[Any] = [system(), marked_user("Question one?")]
    first, reply = await chat_turn(client, messages, TOOLS, stream=False)
    assert first.cached == 0 and first.written > 1024  # a first turn only writes
    assert_counted(kvwarm, [first], ANTHROPIC, {"unknown": first.written})
    saved = metric(kvwarm, "kvwarm_cache_savings_usd_total", model=MODEL, by="cache")
    premium = metric(kvwarm, "kvwarm_cache_write_premium_usd_total", model=MODEL, by="cache")
    assert saved - premium == pytest.approx(-first.written * (WRITE_PRICE - 1) * INPUT / 1e6)  # not repaid yet

    # The agent's next turns: the tools array comes back in another order (kvwarm restores it,
    # so the marked prefix is read), the first reply is echoed, and a streamed turn follows.
    messages = [system(), {"role": "user", "content": "Question one?"}, {"role": "assistant", "content": reply},
                marked_user("Question two?")]
    second, reply2 = await chat_turn(client, messages, TOOLS[::-1], stream=False)
    messages = [*messages[:-1], {"role": "user", "content": "Question two?"}, {"role": "assistant", "content": reply2},
                marked_user("Question three?")]
    third, _ = await chat_turn(client, messages, TOOLS, stream=True)
    turns = [first, second, third]
    assert second.rescued > 0 and second.cached > 0, "the repaired tools kept the marked prefix readable"
    assert third.cached > second.cached and all(t.written > 0 for t in turns)
    assert_counted(kvwarm, turns, ANTHROPIC, {"unknown": sum(t.written for t in turns)})
    net = by_hand(turns)
    assert net["saved"] > net["premium"], "three turns repay the writes"


# -- openai-breakpoints: GPT-5.6's implicit and explicit breakpoints ------------------------------


def developer(ttl: str) -> dict[str, Any]:
    return {"role": "developer", "content": [
        {"type": "input_text", "text": STABLE, "prompt_cache_breakpoint": {"mode": "explicit", "ttl": ttl}},
    ]}


async def responses_turn(client: openai.AsyncOpenAI, items: list[Any], *, stream: bool) -> tuple[Turn, str]:
    """One Responses API request through kvwarm: its usage as a :class:`Turn`, and the reply."""
    if stream:
        events = [event async for event in await client.responses.create(model=MODEL, input=items, stream=True)]
        response = next(e.response for e in events if e.type == "response.completed")
    else:
        response = await client.responses.create(model=MODEL, input=items)
    usage = response.usage
    assert usage is not None
    details = usage.input_tokens_details
    split = details.cache_write_tokens_details
    assert split is not None and details.cache_write_tokens == split.ttl_30m_tokens + split.ttl_12h_tokens
    turn = Turn(usage.input_tokens, details.cached_tokens, details.cache_write_tokens, usage.output_tokens,
                long_written=split.ttl_12h_tokens)
    return turn, response.output_text


async def test_openai_breakpoints_writes_by_ttl_cost_and_savings(
    make_sim: SimFactory, make_proxy: ProxyFactory, openai_client: ClientFactory, tmp_path: Path,
) -> None:
    sim = await make_sim(cache_mode=OPENAI_BREAKPOINTS)
    kvwarm = await make_proxy(sim, metrics__prices_file=str(price_table(tmp_path / "prices.toml")))
    client = openai_client(kvwarm)

    # The instructions are written for 12 hours, the implicit breakpoint (the latest user
    # message) for the request's 30 minutes.
    items: list[Any] = [developer("12h"), {"role": "user", "content": "Question one?"}]
    first, reply = await responses_turn(client, items, stream=False)
    assert first.cached == 0 and first.long_written > 1024 and first.written > first.long_written
    items = [*items, {"role": "assistant", "content": reply}, {"role": "user", "content": "Question two?"}]
    second, _ = await responses_turn(client, items, stream=True)
    assert second.cached > first.long_written and second.written > 0
    # Chat on the same upstream: its usage reports the writes without their TTL.
    chat, _ = await chat_turn(client, [{"role": "system", "content": STABLE}, {"role": "user", "content": "Hi?"}],
                              TOOLS, stream=False)
    assert chat.written > 1024

    turns = [first, second, chat]
    written = {
        "30m": sum(t.written - t.long_written for t in (first, second)),
        "12h": first.long_written + second.long_written,
        "unknown": chat.written,
    }
    assert_counted(kvwarm, turns, OPENAI_BREAKPOINTS, written)
