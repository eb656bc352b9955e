"""The Responses script: which tool the model calls, with what, and when it answers with text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.sim.script import CODE_MODE_SOURCE, harmless_arguments, plan_turn, turn_has_tool_output
from tests.sim.conftest import EXEC_TOOL, SHELL_TOOL, WEATHER_FUNCTION, WEB_SEARCH_TOOL

SEED = b"seed"
USER = {"role": "user", "content": "Go."}


def plan(tools: list[Any] | None, items: list[Any] | None = None, **request: Any) -> Any:
    body: dict[str, Any] = {"model": "m", **request}
    if tools is not None:
        body["tools"] = tools
    return plan_turn(body, items if items is not None else [USER], SEED)


def only_call(turn: Any) -> tuple[str, Any]:
    (call,) = turn.calls
    assert turn.text is None
    return call.name, json.loads(call.arguments)


def test_codex_exec_command_is_preferred_and_called_harmlessly() -> None:
    turn = plan([WEATHER_FUNCTION, SHELL_TOOL, EXEC_TOOL, WEB_SEARCH_TOOL])
    assert only_call(turn) == ("exec_command", {"cmd": "echo kvwarm"})
    assert turn.calls[0].arguments == '{"cmd":"echo kvwarm"}'
    assert turn.calls[0].call_id.startswith("call_")


def test_shell_gets_an_argv_and_shell_command_a_string() -> None:
    assert only_call(plan([WEATHER_FUNCTION, SHELL_TOOL])) == (
        "shell",
        {"command": ["echo", "kvwarm"]},
    )
    string_shell = {
        "type": "function",
        "name": "shell_command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    }
    assert only_call(plan([string_shell])) == ("shell_command", {"command": "echo kvwarm"})
    assert only_call(plan([{"type": "function", "name": "exec_command"}])) == (
        "exec_command",
        {"cmd": "echo kvwarm"},
    )
    assert only_call(plan([{"type": "function", "name": "shell"}])) == (
        "shell",
        {"command": ["echo", "kvwarm"]},
    )


def test_any_function_tool_gets_its_required_properties_in_schema_order() -> None:
    name, arguments = only_call(plan([WEB_SEARCH_TOOL, WEATHER_FUNCTION]))
    assert name == "get_weather"
    assert list(arguments) == ["city", "days"]
    assert isinstance(arguments["city"], str) and isinstance(arguments["days"], int)
    assert (
        harmless_arguments("f", {"type": "object", "properties": {"a": {"type": "string"}}}) == {}
    )


def test_a_tool_output_in_this_turn_means_a_final_message() -> None:
    call = {"type": "function_call", "call_id": "c", "name": "exec_command", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c", "output": "kvwarm\n"}
    items = [USER, call, output]
    assert turn_has_tool_output(items)
    turn = plan([EXEC_TOOL], items)
    assert turn.calls == () and turn.text and turn.text.endswith("\n")
    # A new user message opens a new turn: the model calls the tool again.
    assert turn_has_tool_output([*items, USER]) is False
    assert only_call(plan([EXEC_TOOL], [*items, USER]))[0] == "exec_command"


def test_tool_choice_and_call_count() -> None:
    assert plan([EXEC_TOOL], tool_choice="none").calls == ()
    forced = plan(
        [EXEC_TOOL, WEATHER_FUNCTION], tool_choice={"type": "function", "name": "get_weather"}
    )
    assert only_call(forced)[0] == "get_weather"
    body = {"model": "m", "tools": [EXEC_TOOL, SHELL_TOOL, WEATHER_FUNCTION]}
    three = plan_turn(body, [USER], SEED, tool_calls=3)
    assert [c.name for c in three.calls] == ["exec_command", "shell", "get_weather"]
    assert len({c.call_id for c in three.calls}) == 3
    serial = plan_turn({**body, "parallel_tool_calls": False}, [USER], SEED, tool_calls=3)
    assert len(serial.calls) == 1
    assert plan_turn(body, [USER], SEED, tool_calls=0).calls == ()


def test_no_function_tool_means_text_unless_code_mode_or_local_shell() -> None:
    assert plan([WEB_SEARCH_TOOL]).calls == ()
    assert plan(None).text
    code_mode = {
        "type": "additional_tools",
        "role": "developer",
        "tools": [
            {
                "type": "namespace",
                "name": "functions",
                "tools": [{"type": "custom", "name": "exec", "description": "JS"}],
            }
        ],
    }
    (call,) = plan(None, [code_mode, USER]).calls
    assert (call.kind, call.name, call.arguments) == ("custom_tool_call", "exec", CODE_MODE_SOURCE)
    (shell,) = plan([{"type": "local_shell"}]).calls
    assert shell.kind == "local_shell_call"
    assert json.loads(shell.arguments)["command"] == ["echo", "kvwarm"]


def test_replies_are_deterministic_per_prompt() -> None:
    body = {"model": "m"}
    assert plan_turn(body, [USER], b"a") == plan_turn(body, [USER], b"a")
    assert plan_turn(body, [USER], b"a").text != plan_turn(body, [USER], b"b").text
    longer = plan_turn(body, [USER], b"a", reply_tokens=300).text
    assert longer is not None and len(longer) > 3 * len(plan_turn(body, [USER], b"a").text or "")


@pytest.mark.parametrize(
    ("reasoning", "header", "expected"),
    [
        (None, False, False),
        ({"effort": "none"}, False, False),
        ({"effort": "low"}, False, True),
        ({"summary": "auto"}, False, True),
        (None, True, True),
    ],
)
def test_reasoning_when_asked(reasoning: Any, header: bool, expected: bool) -> None:
    body: dict[str, Any] = {"model": "m"}
    if reasoning is not None:
        body["reasoning"] = reasoning
    turn = plan_turn(body, [USER], SEED, reasoning=header)
    assert (turn.reasoning is not None) is expected
    assert turn.summary is None or reasoning.get("summary") == "auto"


def test_a_summary_differs_from_the_reasoning() -> None:
    turn = plan_turn({"model": "m", "reasoning": {"summary": "detailed"}}, [USER], SEED)
    assert turn.reasoning and turn.summary and turn.summary != turn.reasoning


def test_json_schema_text_format_gets_fitting_json() -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
    }
    turn = plan(None, text={"format": {"type": "json_schema", "name": "A", "schema": schema}})
    assert json.loads(turn.text) == {"answer": 1}
