"""The anthropic mode over HTTP (``cache_control`` markers, as OpenRouter and DashScope take them).

proxy/sim/markers.py: a marked block writes the prefix up to and including it (1024 tokens at
least) for 5 minutes or an hour; a prompt reads at its breakpoints and the 20 blocks before
each; a top-level ``cache_control`` marks the last block; at most 4 marked blocks; nothing is
cached without markers. Usage in OpenRouter's shape; billing at 1.25x / 2x for writes, 0.1x
for reads.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.sim.clock import SimClock
from proxy.sim.render import render_tokens
from tests.sim.conftest import long_system_prompt

MODE = "anthropic"
EPHEMERAL: dict[str, Any] = {"type": "ephemeral"}
HOUR: dict[str, Any] = {"type": "ephemeral", "ttl": "1h"}
STABLE = long_system_prompt(150)

SimFactory = Callable[..., Awaitable[TestServer]]
ClientFactory = Callable[..., openai.AsyncOpenAI]


def system(marker: dict[str, Any] | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "text", "text": STABLE}
    if marker is not None:
        part["cache_control"] = marker
    return {"role": "system", "content": [part]}


def user(text: str, marker: dict[str, Any] | None = None) -> dict[str, Any]:
    if marker is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "text", "text": text, "cache_control": marker}]}


def ends_at(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> int:
    return len(render_tokens(messages, tools, add_generation_prompt=False))


async def ask(client: openai.AsyncOpenAI, messages: list[Any], **extra: Any) -> tuple[int, int]:
    """``(cached_tokens, cache_write_tokens)`` of one chat completion."""
    completion = await client.chat.completions.create(model="claude-sim", messages=messages, **extra)
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    details = completion.usage.prompt_tokens_details
    assert details.cached_tokens is not None and details.cache_write_tokens is not None
    return details.cached_tokens, details.cache_write_tokens


@pytest.fixture
async def cc_client(make_sim: SimFactory, openai_client: ClientFactory) -> openai.AsyncOpenAI:
    return openai_client(await make_sim(cache_mode=MODE))


async def test_nothing_is_cached_without_markers(cc_client: openai.AsyncOpenAI) -> None:
    turn = [system(), user("Question?")]
    assert await ask(cc_client, turn) == (0, 0)
    assert await ask(cc_client, turn) == (0, 0)
    await ask(cc_client, [system(EPHEMERAL), user("Question?")])
    assert await ask(cc_client, turn) == (0, 0)  # written, but an unmarked prompt reads nothing


async def test_a_marked_block_writes_its_prefix_and_a_later_marker_reads_it(
    cc_client: openai.AsyncOpenAI,
) -> None:
    assert await ask(cc_client, [system(EPHEMERAL), user("One?")]) == (0, ends_at([system()]))
    assert await ask(cc_client, [system(EPHEMERAL), user("Two?")]) == (ends_at([system()]), 0)


async def test_more_than_four_marked_blocks_are_refused(cc_client: openai.AsyncOpenAI) -> None:
    parts = [{"type": "text", "text": f"Part {i}. ", "cache_control": EPHEMERAL} for i in range(5)]
    with pytest.raises(openai.BadRequestError) as caught:
        await ask(cc_client, [system(), {"role": "user", "content": parts}])
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["message"] == (
        "A maximum of 4 blocks with cache_control may be provided. Found 5."
    )
    await ask(cc_client, [system(), {"role": "user", "content": parts[:4]}])

    # The top-level marker counts as one, unless its block is marked already.
    four = [system(), {"role": "user", "content": parts[:4]}, user("Last.")]
    with pytest.raises(openai.BadRequestError, match="Found 5"):
        await ask(cc_client, four, extra_body={"cache_control": EPHEMERAL})
    await ask(cc_client, [system(), {"role": "user", "content": parts[:4]}], extra_body={"cache_control": EPHEMERAL})


@pytest.mark.parametrize(
    ("marker", "param"),
    [({"type": "persistent"}, "type"), ({"type": "ephemeral", "ttl": "10m"}, "ttl")],
)
async def test_a_malformed_marker_is_refused(
    cc_client: openai.AsyncOpenAI, marker: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await ask(cc_client, [system(marker), user("Hi.")])
    assert caught.value.param == f"messages[0].content[0].cache_control.{param}"


@pytest.mark.parametrize(("back", "hits"), [(20, True), (21, False)])
async def test_a_breakpoint_reads_a_prefix_up_to_20_blocks_back(
    cc_client: openai.AsyncOpenAI, back: int, hits: bool
) -> None:
    await ask(cc_client, [system(EPHEMERAL), user("Start.")])
    # The written prefix ends at block 0 (the system message); the breakpoint is block `back`.
    filler = [user(f"Note {i}.") for i in range(back - 1)]
    cached, _ = await ask(cc_client, [system(), *filler, user("Now?", EPHEMERAL)])
    assert cached == (ends_at([system()]) if hits else 0)


async def test_a_top_level_marker_caches_the_conversation_as_it_grows(
    cc_client: openai.AsyncOpenAI,
) -> None:
    automatic = {"extra_body": {"cache_control": EPHEMERAL}}
    turn = [system(), user("One?")]
    assert await ask(cc_client, turn, **automatic) == (0, ends_at(turn))
    grown = [*turn, {"role": "assistant", "content": "Answer."}, user("Two?")]
    assert await ask(cc_client, grown, **automatic) == (ends_at(turn), ends_at(grown) - ends_at(turn))


async def test_a_marked_tool_caches_the_tools_block(cc_client: openai.AsyncOpenAI) -> None:
    tool = {
        "type": "function",
        "function": {"name": "lookup", "description": STABLE, "parameters": {"type": "object"}},
        "cache_control": EPHEMERAL,
    }
    bare = {key: value for key, value in tool.items() if key != "cache_control"}
    tools_end = len(render_tokens([], [bare], add_generation_prompt=False))
    assert await ask(cc_client, [user("One?")], tools=[tool]) == (0, tools_end)
    assert await ask(cc_client, [user("Two?")], tools=[tool]) == (tools_end, 0)


async def test_a_message_level_marker_marks_its_last_block(cc_client: openai.AsyncOpenAI) -> None:
    marked = {**system(), "cache_control": EPHEMERAL}
    assert await ask(cc_client, [marked, user("One?")]) == (0, ends_at([system()]))


async def test_five_minutes_refreshed_on_each_read_an_hour_when_asked(
    make_sim: SimFactory, openai_client: ClientFactory
) -> None:
    clock = SimClock(lambda: 0.0)
    client = openai_client(await make_sim(cache_mode=MODE, clock=clock))
    stable = ends_at([system()])

    async def read_back(question: str) -> int:
        # The breakpoint is on the question: the system prefix is read (a block back), not rewritten.
        cached, _ = await ask(client, [system(), user(question, EPHEMERAL)])
        return cached

    await ask(client, [system(EPHEMERAL), user("One?")])
    clock.advance(299)
    assert await read_back("Two?") == stable
    clock.advance(299)  # 598 s after the write, 299 after the read that refreshed it
    assert await read_back("Three?") == stable
    clock.advance(301)
    assert await read_back("Four?") == 0

    await ask(client, [system(HOUR), user("Five?")])
    clock.advance(3000)
    assert await read_back("Six?") == stable
    clock.advance(3601)
    assert await read_back("Seven?") == 0


async def test_usage_can_carry_anthropic_fields_and_billing_prices_writes_and_reads(
    make_sim: SimFactory,
) -> None:
    server = await make_sim(cache_mode=MODE, anthropic_usage=True, openhuman=True)
    async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k") as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="claude-sim", messages=[system(HOUR), user("One?")]
        )
        first = raw.http_response.json()
        raw = await client.chat.completions.with_raw_response.create(
            model="claude-sim", messages=[system(EPHEMERAL), user("Two?")]
        )
        second = raw.http_response.json()
    stable = ends_at([system()])
    assert first["usage"]["cache_creation_input_tokens"] == stable
    assert first["usage"]["cache_read_input_tokens"] == 0
    assert second["usage"]["cache_read_input_tokens"] == stable
    prices = (2.5, 10.0)  # SimConfig's price_input, price_output per 1M tokens

    def charged(payload: dict[str, Any], written: float, read: float) -> float:
        usage = payload["usage"]
        plain = usage["prompt_tokens"] - written - read
        prompt = plain + written * (2.0 if payload is first else 1.25) + read * 0.1
        return (prompt * prices[0] + usage["completion_tokens"] * prices[1]) / 1_000_000

    assert first["openhuman"]["billing"]["charged_amount_usd"] == pytest.approx(charged(first, stable, 0))
    assert second["openhuman"]["billing"]["charged_amount_usd"] == pytest.approx(charged(second, 0, stable))


async def test_responses_read_cache_control_on_input_parts(cc_client: openai.AsyncOpenAI) -> None:
    part = {"type": "input_text", "text": STABLE, "cache_control": EPHEMERAL}
    items: list[Any] = [{"role": "developer", "content": [part]}, {"role": "user", "content": "One?"}]
    first = await cc_client.responses.create(model="claude-sim", input=items)
    second = await cc_client.responses.create(model="claude-sim", input=[*items[:1], {"role": "user", "content": "Two?"}])
    assert first.usage is not None and second.usage is not None
    written = first.usage.input_tokens_details.cache_write_tokens
    assert written == ends_at([{"role": "developer", "content": STABLE}])
    assert second.usage.input_tokens_details.cached_tokens == written
