"""The real Codex CLI (``codex exec``) against Responses API upstreams, no kvwarm in between.

Against the scripted capture upstream: what Codex sends (the command tool, a
call and its output, turn 1's items re-sent byte for byte), in both of its
tool modes. Against the reference upstream: a complete two-request session
with a tool call, checked on both sides.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.clients.capture import (
    CODE_MODE_SOURCE,
    COMMAND_MARKER,
    FINAL_TEXT,
    CaptureState,
    compare_turns,
)
from tests.clients.codex import DEFAULT_MODEL, THROWAWAY_KEY, run_codex
from tests.clients.conftest import Upstream

pytestmark = pytest.mark.timeout(300)  # the real Codex CLI, each run bounded at 90 s
PROMPT = "Run `echo kvwarm` in the shell, then say done."


def _user_texts(body: dict[str, Any]) -> list[str]:
    return [
        part.get("text", "")
        for item in body["input"]
        if item.get("type") == "message" and item.get("role") == "user"
        for part in item.get("content") or []
    ]


def _one(items: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [item for item in items if item.get("type") == kind]
    assert len(found) == 1, f"expected one {kind} item, got {[i.get('type') for i in items]}"
    return found[0]


async def test_codex_calls_the_command_tool_and_resends_turn_one_byte_identically(
    codex_bin: Path, capture: tuple[str, CaptureState], tmp_path: Path
) -> None:
    url, state = capture
    run = await run_codex(url, PROMPT, workdir=tmp_path / "work", timeout=90)
    assert run.returncode == 0, run.summary()

    posts = state.responses()
    assert len(posts) == 2, run.summary()
    first, second = posts
    turn1, turn2 = first.json(), second.json()
    assert turn1["model"] == DEFAULT_MODEL
    assert turn1["stream"] is True and turn1["store"] is False
    assert [t.get("name") for t in turn1["tools"] if t.get("name") == "exec_command"] == ["exec_command"]
    assert PROMPT in _user_texts(turn1)
    assert first.headers.get("authorization") == f"Bearer {THROWAWAY_KEY}"
    assert first.headers.get("originator") == "codex_exec"

    new_items = turn2["input"][len(turn1["input"]):]
    call, output = _one(new_items, "function_call"), _one(new_items, "function_call_output")
    assert call["name"] == "exec_command"
    assert json.loads(call["arguments"]) == {"cmd": f"echo {COMMAND_MARKER}"}
    assert output["call_id"] == call["call_id"]
    assert f"{COMMAND_MARKER}\n" in output["output"]  # the command really ran

    comparison = compare_turns(first.body, second.body)
    assert comparison["changed_fields"] == [], comparison
    assert comparison["items_bytes_prefix"], comparison

    # The temporary CODEX_HOME, never the real one, is what Codex used.
    assert str(Path.home() / ".codex") not in second.body.decode()

    commands = run.items("command_execution")
    assert [c["exit_code"] for c in commands] == [0], run.summary()
    assert commands[0]["aggregated_output"] == f"{COMMAND_MARKER}\n"
    assert run.last_message is not None and run.last_message.strip() == FINAL_TEXT


async def test_codex_default_model_runs_commands_through_code_mode(
    codex_bin: Path, capture: tuple[str, CaptureState], tmp_path: Path
) -> None:
    url, state = capture
    run = await run_codex(url, PROMPT, workdir=tmp_path / "work", timeout=90, model=None)
    assert run.returncode == 0, run.summary()

    posts = state.responses()
    assert len(posts) == 2, run.summary()
    turn1, turn2 = posts[0].json(), posts[1].json()
    assert "tools" not in turn1
    assert turn1["input"][0]["type"] == "additional_tools"

    new_items = turn2["input"][len(turn1["input"]):]
    call, output = _one(new_items, "custom_tool_call"), _one(new_items, "custom_tool_call_output")
    assert (call["name"], call["input"]) == ("exec", CODE_MODE_SOURCE)
    assert output["call_id"] == call["call_id"]
    assert COMMAND_MARKER in json.dumps(output["output"])

    comparison = compare_turns(posts[0].body, posts[1].body)
    assert comparison["changed_fields"] == [] and comparison["items_bytes_prefix"], comparison
    assert run.last_message is not None and run.last_message.strip() == FINAL_TEXT


async def test_codex_completes_a_tool_session_against_the_reference_upstream(
    codex_bin: Path, sim_upstream: Upstream, tmp_path: Path
) -> None:
    run = await run_codex(sim_upstream.base_url, PROMPT, workdir=tmp_path / "work", timeout=90)
    assert run.returncode == 0, run.summary()

    entries = [e for e in await sim_upstream.received() if e["path"] == "/v1/responses"]
    assert len(entries) == 2, run.summary()
    turn1, turn2 = (json.loads(e["body"]) for e in entries)
    assert PROMPT in _user_texts(turn1)
    assert turn2["input"][: len(turn1["input"])] == turn1["input"]

    new_items = turn2["input"][len(turn1["input"]):]
    call, output = _one(new_items, "function_call"), _one(new_items, "function_call_output")
    assert call["name"] == "exec_command"
    command = json.loads(call["arguments"])["cmd"]
    assert output["call_id"] == call["call_id"]

    commands = run.items("command_execution")
    assert len(commands) == 1 and commands[0]["exit_code"] == 0, run.summary()
    assert command in commands[0]["command"]
    printed = commands[0]["aggregated_output"]
    assert printed.strip() and printed in output["output"]  # what ran went back upstream

    # Codex asks for reasoning (``reasoning``, ``include: reasoning.encrypted_content``, ``store:
    # false``): the upstream's reasoning item must come back whole, encrypted content included.
    reasoning = _one(new_items, "reasoning")
    assert reasoning["encrypted_content"]
    shown = [r["text"] for r in run.items("reasoning")]
    assert shown and shown[0] == reasoning["summary"][0]["text"], run.summary()

    messages = run.items("agent_message")
    assert messages and messages[-1]["text"].strip(), run.summary()
    assert run.last_message is not None and run.last_message.strip() == messages[-1]["text"].strip()
