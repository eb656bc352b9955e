"""The Responses template: what renders, what does not, and that an echoed turn renders as generated."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from proxy.sim.items import (
    InputError,
    input_items,
    reasoning_text,
    render_response_segments,
    to_messages,
)
from proxy.sim.render import (
    encode_segments,
    generation_prompt_segments,
    render_tokens,
    reply_segments,
    segments_text,
)
from proxy.sim.script import Call, Turn
from proxy.sim.sealed import open_sealed, seal
from tests.sim.conftest import EXEC_TOOL, SHELL_TOOL, WEB_SEARCH_TOOL, long_system_prompt

USER = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Run it."}]}
CALL = {
    "type": "function_call",
    "id": "fc_1",
    "status": "completed",
    "call_id": "call_1",
    "name": "exec_command",
    "arguments": '{"cmd":"echo kvwarm"}',
}
OUTPUT = {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "kvwarm\n"}


def tokens(
    items: list[Any], *, instructions: Any = None, tools: list[Any] | None = None
) -> list[int]:
    return encode_segments(render_response_segments(instructions, items, tools or []))


def test_string_content_renders_as_one_text_part_and_as_an_easy_message() -> None:
    typed = [USER]
    easy = [{"role": "user", "content": "Run it."}]
    string_content = [{"type": "message", "role": "user", "content": "Run it."}]
    output_part = [{"role": "user", "content": [{"type": "output_text", "text": "Run it."}]}]
    assert tokens(typed) == tokens(easy) == tokens(string_content) == tokens(output_part)
    assert tokens(input_items("Run it.")) == tokens(typed)
    assert tokens([{"role": "user", "content": "Run it!"}]) != tokens(typed)


def test_instructions_and_messages_render_like_the_chat_template() -> None:
    items = [{"role": "developer", "content": "Be careful."}, USER]
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Be careful."},
        {"role": "user", "content": "Run it."},
    ]
    assert tokens(items, instructions="Be brief.") == render_tokens(chat, None)
    assert tokens(items, instructions="") == render_tokens(chat[1:], None)
    assert tokens(items, instructions="Be brief. ") != tokens(items, instructions="Be brief.")


def test_ids_status_and_call_ids_do_not_render() -> None:
    items = [USER, CALL, OUTPUT]
    renamed = copy.deepcopy(items)
    renamed[0]["id"] = "msg_0123"
    renamed[1].update(id="fc_other", call_id="call_other", status="in_progress")
    renamed[2].update(id="fco_other", call_id="call_other")
    del renamed[1]["status"]
    assert tokens(renamed) == tokens(items)


def test_nulls_render_nothing() -> None:
    with_nulls = [{**USER, "id": None, "status": None}, {**CALL, "namespace": None}, OUTPUT]
    assert tokens(with_nulls) == tokens([USER, CALL, OUTPUT])


@pytest.mark.parametrize(
    "arguments", ['{"cmd": "echo kvwarm"}', '{"cmd":"echo kvwarm" }', '{"cmd":"echo kvwarm!"}']
)
def test_argument_strings_render_raw(arguments: str) -> None:
    changed = {**CALL, "arguments": arguments}
    assert tokens([USER, changed, OUTPUT]) != tokens([USER, CALL, OUTPUT])


def test_whitespace_in_texts_and_outputs_renders() -> None:
    base = tokens([USER, CALL, OUTPUT])
    assert tokens([USER, CALL, {**OUTPUT, "output": "kvwarm"}]) != base
    stripped = {"role": "user", "content": [{"type": "input_text", "text": "Run it. "}]}
    assert tokens([stripped, CALL, OUTPUT]) != base


def test_tool_order_and_schema_key_order_render() -> None:
    tools = [EXEC_TOOL, SHELL_TOOL, WEB_SEARCH_TOOL]
    base = tokens([USER], tools=tools)
    assert tokens([USER], tools=[SHELL_TOOL, EXEC_TOOL, WEB_SEARCH_TOOL]) != base
    params = EXEC_TOOL["parameters"]
    reordered = {**EXEC_TOOL, "parameters": dict(reversed(list(params.items())))}
    assert tokens([USER], tools=[reordered, SHELL_TOOL, WEB_SEARCH_TOOL]) != base
    assert tokens([USER], tools=copy.deepcopy(tools)) == base
    text = segments_text(render_response_segments(None, [USER], tools))
    assert '{"type":"web_search"}' in text and '"name":"exec_command"' in text


def test_an_echoed_turn_renders_exactly_as_generated() -> None:
    """Generation prompt + generated body == the same turn echoed as items (vLLM reuse depends on it)."""
    reasoning = "I should run the command first."
    turn = Turn(
        reasoning=reasoning, summary=None, text=None, calls=(Call(kind="function_call", call_id="call_1", name=CALL["name"], arguments=CALL["arguments"]),)
    )
    prompt = render_response_segments("Be brief.", [USER], [EXEC_TOOL])
    generated = encode_segments(prompt + reply_segments(turn.message()))
    echoed_items = [
        USER,
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": seal(reasoning)},
        CALL,
        OUTPUT,
    ]
    echoed = tokens(echoed_items, instructions="Be brief.", tools=[EXEC_TOOL])
    assert echoed[: len(generated)] == generated
    assert prompt[-2:] == generation_prompt_segments()

    text_turn = Turn(reasoning=None, summary=None, text="Done.\n", calls=())
    generated_text = encode_segments(prompt + reply_segments(text_turn.message()))
    message = {
        "type": "message",
        "role": "assistant",
        "id": "msg_1",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Done.\n", "annotations": []}],
    }
    echoed_text = tokens([USER, message], instructions="Be brief.", tools=[EXEC_TOOL])
    assert echoed_text[: len(generated_text)] == generated_text


def test_reasoning_renders_the_sealed_reasoning_not_the_summary() -> None:
    sealed = {
        "type": "reasoning",
        "id": "rs_1",
        "encrypted_content": seal("Deep thought."),
        "summary": [{"type": "summary_text", "text": "**Thinking**"}],
    }
    assert reasoning_text(sealed) == "Deep thought."
    without = {k: v for k, v in sealed.items() if k != "encrypted_content"}
    assert reasoning_text(without) == "**Thinking**"
    raw = {**without, "content": [{"type": "reasoning_text", "text": "Raw thought."}]}
    assert reasoning_text(raw) == "Raw thought."
    foreign = {**sealed, "encrypted_content": "gAAAAABforeign"}
    assert reasoning_text(foreign) == "gAAAAABforeign"
    assert tokens([USER, sealed, CALL, OUTPUT]) != tokens([USER, without, CALL, OUTPUT])
    assert tokens([USER, sealed, CALL, OUTPUT]) != tokens([USER, CALL, OUTPUT])


def test_sealing_round_trips_and_refuses_tampering() -> None:
    text = "Le café est prêt — 北京.\n" * 10
    sealed = seal(text)
    assert open_sealed(sealed) == text
    assert seal(text) == sealed
    assert text not in sealed
    flipped = sealed[:30] + ("A" if sealed[30] != "A" else "B") + sealed[31:]
    assert open_sealed(flipped) is None
    assert open_sealed("not base64 at all!") is None
    assert open_sealed("") is None


def test_assistant_items_group_into_one_message_until_a_tool_output() -> None:
    message = {"role": "assistant", "content": "Running it."}
    second = {**CALL, "call_id": "call_2", "arguments": '{"cmd":"ls"}'}
    messages = to_messages(
        None, [USER, message, CALL, second, OUTPUT, {**OUTPUT, "call_id": "call_2"}]
    )
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "Running it."
    assert [c["function"]["arguments"] for c in messages[1]["tool_calls"]] == [
        CALL["arguments"],
        second["arguments"],
    ]


def test_other_item_types_render_their_json_without_id_and_status() -> None:
    extra = {"type": "additional_tools", "id": "at_1", "role": "developer", "tools": [EXEC_TOOL]}
    messages = to_messages(None, [extra, USER])
    assert messages[0]["role"] == "additional_tools"
    assert "at_1" not in messages[0]["content"]
    renamed = {**extra, "id": "at_2"}
    assert tokens([renamed, USER]) == tokens([extra, USER])


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([OUTPUT], "input"),
        ([USER, {**CALL, "arguments": {"cmd": "ls"}}], "input[1].arguments"),
        ([{"role": "tool", "content": "x"}], "input[0].role"),
        ([{"content": "no type, no role"}], "input[0].type"),
        ([{"role": "user", "content": 3}], "input[0].content"),
    ],
)
def test_refused_inputs_name_the_field(items: list[Any], param: str) -> None:
    with pytest.raises(InputError) as caught:
        to_messages(None, items)
    assert caught.value.param == param


def test_long_prompt_is_stable() -> None:
    instructions = long_system_prompt()
    assert tokens([USER], instructions=instructions) == tokens([USER], instructions=instructions)
    assert len(tokens([USER], instructions=instructions)) > 1024
