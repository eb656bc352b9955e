"""The openai-breakpoints mode over HTTP, with the official openai SDK as the client.

GPT-5.6 semantics (proxy/sim/markers.py): an implicit breakpoint at the latest user or tool
message, explicit ``prompt_cache_breakpoint`` markers, ``prompt_cache_options``, writes of at
most four prefixes of at least 1024 tokens, reads of the longest written prefix among a key's
80 most recent, TTLs on the emulator's clock, and ``cache_write_tokens`` in usage.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import openai
import orjson
import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from proxy.sim.clock import SimClock
from proxy.sim.render import render_tokens
from tests.sim.conftest import long_system_prompt

MODE = "openai-breakpoints"
BP: dict[str, Any] = {"mode": "explicit"}
STABLE = long_system_prompt(150)
"""About 1950 tokens: well above the 1024-token minimum."""

SimFactory = Callable[..., Awaitable[TestServer]]
ClientFactory = Callable[..., openai.AsyncOpenAI]


@dataclass(frozen=True)
class Used:
    prompt: int
    cached: int
    written: int


def system(text: str = STABLE, breakpoint: dict[str, Any] | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "text", "text": text}
    if breakpoint is not None:
        part["prompt_cache_breakpoint"] = breakpoint
    return {"role": "system", "content": [part]}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def ends_at(messages: list[dict[str, Any]]) -> int:
    """Tokens of the prompt up to the end of the last of ``messages``."""
    return len(render_tokens(messages, None, add_generation_prompt=False))


async def ask(client: openai.AsyncOpenAI, messages: list[Any], **extra: Any) -> Used:
    completion = await client.chat.completions.create(model="gpt-sim", messages=messages, **extra)
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    details = usage.prompt_tokens_details
    assert details.cached_tokens is not None and details.cache_write_tokens is not None
    return Used(usage.prompt_tokens, details.cached_tokens, details.cache_write_tokens)


@pytest.fixture
async def bp_client(make_sim: SimFactory, openai_client: ClientFactory) -> openai.AsyncOpenAI:
    return openai_client(await make_sim(cache_mode=MODE))


# -- the implicit breakpoint, explicit breakpoints, options ---------------------------------------


async def test_a_stable_prefix_before_a_changing_message_hits_only_with_an_explicit_breakpoint(
    bp_client: openai.AsyncOpenAI,
) -> None:
    first = await ask(bp_client, [system(), user("Question one?")])
    second = await ask(bp_client, [system(), user("Question two?")])
    assert (first.cached, first.written) == (0, ends_at([system(), user("Question one?")]))
    # The implicit breakpoint wrote the prefix ending after "Question one?": nothing to read.
    assert second.cached == 0

    await ask(bp_client, [system(breakpoint=BP), user("Question three?")])
    fourth = await ask(bp_client, [system(breakpoint=BP), user("Question four?")])
    assert fourth.cached == ends_at([system()]) > 1024
    # It writes from there to its own implicit breakpoint.
    assert fourth.written == ends_at([system(), user("Question four?")]) - fourth.cached


async def test_a_growing_conversation_reads_the_last_turn_and_writes_only_new_tokens(
    bp_client: openai.AsyncOpenAI,
) -> None:
    turn = [system(), user("Question one?")]
    first = await ask(bp_client, turn)
    grown = [*turn, {"role": "assistant", "content": "Answer one."}, user("Question two?")]
    second = await ask(bp_client, grown)
    again = await ask(bp_client, grown)
    assert first.written == ends_at(turn)
    assert second.cached == ends_at(turn)
    assert second.written == ends_at(grown) - ends_at(turn)
    assert (again.cached, again.written) == (ends_at(grown), 0)
    assert second.prompt == again.prompt > ends_at(grown)  # the whole prompt, read or not


async def test_one_request_writes_each_token_once_however_many_prefixes_hold_it(
    bp_client: openai.AsyncOpenAI,
) -> None:
    both = await ask(bp_client, [system(breakpoint=BP), user("Question one?")])
    assert both.written == ends_at([system(), user("Question one?")])  # not the two prefixes summed
    probe = await ask(bp_client, [system(), user("Another question?")])
    assert probe.cached == ends_at([system()])  # the explicit prefix was written too


async def test_explicit_mode_turns_the_implicit_breakpoint_off(
    bp_client: openai.AsyncOpenAI,
) -> None:
    explicit = {"mode": "explicit"}
    unmarked = [system(), user("Question one?")]
    for _ in range(2):
        used = await ask(bp_client, unmarked, prompt_cache_options=explicit)
        assert (used.cached, used.written) == (0, 0)  # no breakpoint: no caching at all

    marked = [system(breakpoint=BP), user("Question two?")]
    await ask(bp_client, marked, prompt_cache_options=explicit)
    repeat = await ask(bp_client, marked, prompt_cache_options=explicit)
    assert repeat.cached == ends_at([system()])  # not up to the user message: no implicit write

    await ask(bp_client, marked)
    implicit = await ask(bp_client, marked)
    assert implicit.cached == ends_at(marked)


async def test_only_the_latest_four_explicit_breakpoints_are_written(
    bp_client: openai.AsyncOpenAI,
) -> None:
    sections = [
        {"role": "developer", "content": [{"type": "text", "text": f"Section {i}.", **{"prompt_cache_breakpoint": BP}}]}
        for i in range(2, 6)
    ]
    five = [system(breakpoint=BP), *sections, user("Go.")]
    # OpenAI documents "writes up to the latest four explicit breakpoints": more is no error.
    used = await ask(bp_client, five, prompt_cache_options={"mode": "explicit"})
    assert used.written == ends_at(five[:5])

    first_only = await ask(bp_client, [system(), user("Probe one.")])
    assert first_only.cached == 0  # the earliest breakpoint was not written
    two = await ask(bp_client, [system(), sections[0], user("Probe two.")])
    assert two.cached == ends_at([system(), sections[0]])


async def test_a_prefix_under_1024_tokens_is_never_written(bp_client: openai.AsyncOpenAI) -> None:
    options = {"mode": "explicit"}
    short = [system(long_system_prompt(78), BP), user("Hi.")]
    assert ends_at(short[:1]) == 1020
    for _ in range(2):
        used = await ask(bp_client, short, prompt_cache_options=options)
        assert (used.cached, used.written) == (0, 0)

    enough = [system(long_system_prompt(80), BP), user("Hi.")]
    first = await ask(bp_client, enough, prompt_cache_options=options)
    second = await ask(bp_client, enough, prompt_cache_options=options)
    assert first.written == second.cached == ends_at(enough[:1]) == 1046


async def test_a_key_reads_only_its_80_most_recent_breakpoints(
    make_sim: SimFactory, openai_client: ClientFactory
) -> None:
    server = await make_sim(cache_mode=MODE)
    async with ClientSession() as session:  # plain aiohttp for the bulk: quicker than the SDK
        for i in range(81):
            body = {"model": "gpt-sim", "prompt_cache_key": "k", "messages": [system(), user(f"Turn {i}.")]}
            async with session.post(server.make_url("/v1/chat/completions"), data=orjson.dumps(body)) as r:
                assert r.status == 200
    sdk = openai_client(server)
    newest_but_80 = await ask(sdk, [system(), user("Turn 1."), user("Probe.")], prompt_cache_key="k")
    assert newest_but_80.cached == ends_at([system(), user("Turn 1.")])
    oldest = await ask(sdk, [system(), user("Turn 0."), user("Probe.")], prompt_cache_key="k")
    assert oldest.cached == 0  # written 81 breakpoints ago: out of the window
    other_key = await ask(sdk, [system(), user("Turn 2."), user("Probe.")], prompt_cache_key="other")
    assert other_key.cached == 0  # another key, another window


# -- refusals ---------------------------------------------------------------------------------------


async def refused(call: Awaitable[Any]) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        await call
    return caught.value


async def test_a_breakpoint_on_assistant_content_or_a_tool_is_refused(
    bp_client: openai.AsyncOpenAI,
) -> None:
    assistant = {"role": "assistant", "content": [{"type": "text", "text": "Sure.", "prompt_cache_breakpoint": BP}]}
    error = await refused(ask(bp_client, [system(), assistant, user("And?")]))
    assert error.param == "messages[1].content[0].prompt_cache_breakpoint"
    assert "assistant" in error.message

    tool = {"type": "function", "function": {"name": "f", "parameters": {}}, "prompt_cache_breakpoint": BP}
    error = await refused(ask(bp_client, [system(), user("Hi.")], tools=[tool]))
    assert error.param == "tools[0].prompt_cache_breakpoint"

    output_text = {"type": "output_text", "text": "Sure.", "prompt_cache_breakpoint": BP}
    response = bp_client.responses.create(
        model="gpt-sim",
        input=[
            {"role": "user", "content": "Hi."},
            {"type": "message", "role": "assistant", "content": [output_text]},
            {"role": "user", "content": "And?"},
        ],
    )
    error = await refused(response)
    assert error.param == "input[1].content[0].prompt_cache_breakpoint"


async def test_prompt_cache_options_beside_prompt_cache_retention_is_refused(
    bp_client: openai.AsyncOpenAI,
) -> None:
    call = ask(
        bp_client,
        [system(), user("Hi.")],
        prompt_cache_options={"mode": "implicit"},
        prompt_cache_retention="24h",
    )
    error = await refused(call)
    assert error.param == "prompt_cache_retention"
    used = await ask(bp_client, [system(), user("Hi.")], prompt_cache_retention="24h")
    assert used.written > 0  # alone, the deprecated field is accepted (and does not interact)


@pytest.mark.parametrize(
    ("messages", "options", "param"),
    [
        ([system(breakpoint={"mode": "implicit"}), user("Hi.")], None, "messages[0].content[0].prompt_cache_breakpoint.mode"),
        ([system(breakpoint={"mode": "explicit", "ttl": "1h"}), user("Hi.")], None, "messages[0].content[0].prompt_cache_breakpoint.ttl"),
        ([system(), user("Hi.")], {"mode": "sometimes"}, "prompt_cache_options.mode"),
        ([system(), user("Hi.")], {"ttl": "12h"}, "prompt_cache_options.ttl"),  # chat: 30m only
    ],
)
async def test_malformed_markers_and_options_are_refused(
    bp_client: openai.AsyncOpenAI, messages: list[Any], options: Any, param: str
) -> None:
    extra = {} if options is None else {"extra_body": {"prompt_cache_options": options}}
    error = await refused(ask(bp_client, messages, **extra))
    assert error.param == param


async def test_other_modes_ignore_breakpoints_and_options(
    make_sim: SimFactory, openai_client: ClientFactory
) -> None:
    client = openai_client(await make_sim(cache_mode="openai"))
    assistant = {"role": "assistant", "content": [{"type": "text", "text": "Sure.", "prompt_cache_breakpoint": BP}]}
    completion = await client.chat.completions.create(
        model="gpt-sim",
        messages=[system(breakpoint=BP), assistant, user("Hi.")],
        prompt_cache_options={"mode": "explicit"},
        prompt_cache_retention="24h",
    )
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cache_write_tokens is None  # not reported


# -- TTLs on the emulator's clock -----------------------------------------------------------------


async def test_a_breakpoint_lives_its_ttl_since_its_last_use(
    make_sim: SimFactory, openai_client: ClientFactory
) -> None:
    clock = SimClock(lambda: 0.0)
    client = openai_client(await make_sim(cache_mode=MODE, clock=clock))
    stable = ends_at([system()])
    await ask(client, [system(breakpoint=BP), user("Question?")])
    # Each later prompt reads the explicit prefix without rewriting it (its own implicit
    # breakpoint is elsewhere): only the read keeps the prefix alive.
    clock.advance(30 * 60)
    assert (await ask(client, [system(), user("Two?")])).cached == stable  # exactly the TTL: alive
    clock.advance(30 * 60 - 1)
    assert (await ask(client, [system(), user("Three?")])).cached == stable  # the read refreshed it
    clock.advance(30 * 60 + 1)
    turn = [system(), user("Four?")]
    expired = await ask(client, turn)
    assert (expired.cached, expired.written) == (0, ends_at(turn))

    await ask(client, [system(breakpoint={"mode": "explicit", "ttl": "12h"}), user("Later?")])
    clock.advance(11 * 3600)
    assert (await ask(client, [system(), user("Much later?")])).cached == stable


async def test_the_implicit_ttl_can_be_shorter_than_the_explicit_one(
    make_sim: SimFactory, openai_client: ClientFactory
) -> None:
    clock = SimClock(lambda: 0.0)
    client = openai_client(await make_sim(cache_mode=MODE, clock=clock, implicit_ttl_seconds=300))
    turn = [system(breakpoint=BP), user("Question?")]
    await ask(client, turn)
    clock.advance(301)
    used = await ask(client, turn)
    assert used.cached == ends_at([system()])  # the implicit prefix expired, the explicit one lives
    assert used.written == ends_at(turn) - ends_at([system()])


# -- the Responses API: usage, markers on items, diagnostics ------------------------------------------


def input_text(text: str, breakpoint: dict[str, Any] | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "input_text", "text": text}
    if breakpoint is not None:
        part["prompt_cache_breakpoint"] = breakpoint
    return part


async def test_responses_usage_splits_writes_by_ttl_and_reads_item_breakpoints(
    bp_client: openai.AsyncOpenAI,
) -> None:
    instructions = {"role": "developer", "content": [input_text(STABLE, {"mode": "explicit", "ttl": "12h"})]}
    call = {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "a.txt", "prompt_cache_breakpoint": BP}
    first = await bp_client.responses.create(
        model="gpt-sim",
        input=[instructions, {"role": "user", "content": "List."}, call, output, {"role": "user", "content": "Now?"}],
        prompt_cache_options={"mode": "explicit"},
    )
    assert first.usage is not None
    details = first.usage.input_tokens_details
    assert details.cached_tokens == 0
    assert details.cache_write_tokens_details is not None
    long = details.cache_write_tokens_details.ttl_12h_tokens
    short = details.cache_write_tokens_details.ttl_30m_tokens
    assert details.cache_write_tokens == long + short and long > 1024 and short > 0
    assert first.prompt_cache_options is not None
    assert (first.prompt_cache_options.mode, first.prompt_cache_options.ttl) == ("explicit", "30m")

    changed = await bp_client.responses.create(
        model="gpt-sim",
        input=[instructions, {"role": "user", "content": "List."}, call, output, {"role": "user", "content": "Else?"}],
    )
    assert changed.usage is not None
    assert changed.usage.input_tokens_details.cached_tokens == long + short  # up to the tool output


async def respond(client: openai.AsyncOpenAI, text: str, **extra: Any) -> Any:
    return await client.responses.create(
        model=extra.pop("model", "gpt-sim"),
        input=[{"role": "developer", "content": [input_text(STABLE)]}, {"role": "user", "content": text}],
        **extra,
    )


def diagnostics_of(response: Any) -> dict[str, Any]:
    assert response.prompt_cache_diagnostics is not None
    return dict(response.model_dump()["prompt_cache_diagnostics"])


async def test_diagnostics_explain_a_miss_against_an_earlier_response(
    make_sim: SimFactory, openai_client: ClientFactory
) -> None:
    clock = SimClock(lambda: 0.0)
    client = openai_client(await make_sim(cache_mode=MODE, clock=clock))
    base = await respond(client, "Question one?")
    assert base.prompt_cache_diagnostics is None  # not asked for
    reusable = base.usage.input_tokens_details.cache_write_tokens
    compare = {"comparison_response_id": base.id}

    same = await respond(client, "Question one?", prompt_cache_options=compare)
    assert diagnostics_of(same) == {"type": "cache_hit"}
    assert same.prompt_cache_options.comparison_response_id == base.id

    changed = await respond(client, "Question two?", prompt_cache_options=compare)
    assert diagnostics_of(changed) == {
        "type": "cache_miss",
        "reason": "input_changed",
        "cache_missed_tokens": changed.usage.input_tokens - _developer_end(),
        "comparison_reusable_tokens": reusable,
    }

    other_model = await respond(client, "Question one?", model="gpt-other", prompt_cache_options=compare)
    assert diagnostics_of(other_model)["reason"] == "model_changed"

    clock.advance(31 * 60)
    expired = await respond(client, "Question one?", prompt_cache_options=compare)
    assert diagnostics_of(expired) == {
        "type": "unavailable",  # OpenAI names no reason for it: the emulator's own is sim_reason
        "sim_reason": "expired",
        "cache_missed_tokens": expired.usage.input_tokens,
        "comparison_reusable_tokens": reusable,
    }

    unknown = await respond(client, "Question one?", prompt_cache_options={"comparison_response_id": "resp_nope"})
    assert diagnostics_of(unknown) == {"type": "comparison_response_not_found"}


def _developer_end() -> int:
    return ends_at([{"role": "developer", "content": STABLE}])


async def test_diagnostics_say_when_the_compared_response_wrote_nothing(
    bp_client: openai.AsyncOpenAI,
) -> None:
    base = await bp_client.responses.create(model="gpt-sim", input="Short question?")
    again = await bp_client.responses.create(
        model="gpt-sim", input="Short question?", prompt_cache_options={"comparison_response_id": base.id}
    )
    assert diagnostics_of(again)["type"] == "unavailable"
    assert diagnostics_of(again)["sim_reason"] == "not_written"


async def test_streams_carry_the_cache_report(bp_client: openai.AsyncOpenAI) -> None:
    base = await respond(bp_client, "Question one?")
    stream = await respond(
        bp_client, "Question one?", stream=True, prompt_cache_options={"comparison_response_id": base.id}
    )
    events = [event async for event in stream]
    assert events[0].response.prompt_cache_options is not None
    completed = events[-1].response
    assert diagnostics_of(completed) == {"type": "cache_hit"}
    assert completed.usage.input_tokens_details.cached_tokens > 1024

    chunks = await bp_client.chat.completions.create(
        model="gpt-sim",
        messages=[system(), user("Question?")],
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage async for chunk in chunks if chunk.usage is not None]
    assert usage[0].prompt_tokens_details is not None
    assert usage[0].prompt_tokens_details.cache_write_tokens == ends_at([system(), user("Question?")])
