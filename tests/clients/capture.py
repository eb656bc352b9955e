"""A tiny scripted Responses API upstream that records what real clients send.

``POST /v1/responses`` answers with a minimal valid Responses SSE stream (or a
JSON ``response`` object when the request does not ask to stream), following
a two-step script: a request whose ``input`` carries no ``function_call_output``
gets one ``function_call`` to the client's command tool (the first tool it
offers that :func:`command_call` knows how to call, with harmless arguments);
a request that carries one gets a final assistant message. Every request, to
any path, is recorded with its raw body bytes and headers.

Run as a script to (re)capture the fixtures in ``tests/fixtures/responses/``::

    .venv/bin/python -m tests.clients.capture codex    # needs .ci/install/codex.sh
    .venv/bin/python -m tests.clients.capture agents
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

FINAL_TEXT = "All done: the command ran."
"""The scripted final message, after the tool's output came back."""

COMMAND_MARKER = "kvwarm-capture-ok"
"""What the scripted command prints: harmless, and easy to find in the tool output."""


@dataclass(frozen=True)
class Captured:
    """One request the capture server received."""

    method: str
    path: str
    headers: dict[str, str]
    """Lower-cased names."""
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class CaptureState:
    requests: list[Captured] = field(default_factory=list)
    counter: int = 0

    def responses(self) -> list[Captured]:
        return [r for r in self.requests if r.method == "POST" and r.path.endswith("/responses")]


CAPTURE_STATE = web.AppKey("capture_state", CaptureState)


def _tool_name(tool: dict[str, Any]) -> str:
    return str(tool.get("name") or (tool.get("function") or {}).get("name") or "")


def command_call(tools: list[dict[str, Any]]) -> tuple[str, str] | None:
    """``(tool name, arguments JSON)``: a harmless call to the offered command tool (Codex's
    ``exec_command`` / ``shell`` / ``shell_command``), else to the first function tool with sample
    values for its required arguments (openai-agents' ``@function_tool``); ``None`` without tools."""
    functions = [tool for tool in tools if tool.get("type") == "function"]
    for tool in functions:
        name = _tool_name(tool)
        props = (tool.get("parameters") or {}).get("properties") or {}
        command = props.get("command") or {}
        if name == "exec_command" or "cmd" in props:
            return name, json.dumps({"cmd": f"echo {COMMAND_MARKER}"})
        if name == "shell_command" or command.get("type") == "string":
            return name, json.dumps({"command": f"echo {COMMAND_MARKER}"})
        if name == "shell" or command.get("type") == "array":
            return name, json.dumps({"command": ["echo", COMMAND_MARKER]})
    for tool in functions:
        parameters = tool.get("parameters") or {}
        props = parameters.get("properties") or {}
        args = {key: _sample(props.get(key) or {}) for key in parameters.get("required") or []}
        return _tool_name(tool), json.dumps(args)
    return None


def _sample(schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    if kind == "integer":
        return 7
    if kind == "number":
        return 1.5
    if kind == "boolean":
        return True
    if kind == "array":
        return []
    if kind == "object":
        return {}
    return "Paris"


def _has_tool_output(body: dict[str, Any]) -> bool:
    items = body.get("input")
    if not isinstance(items, list):
        return False
    return any(isinstance(i, dict) and i.get("type", "").endswith("_call_output") for i in items)


def _response(rid: str, model: str, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    usage = {
        "input_tokens": 100,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 10,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 110,
    }
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "temperature": 1.0,
        "top_p": 1.0,
        "usage": usage if status == "completed" else None,
    }


CODE_MODE_SOURCE = f'const r = await tools.exec_command({{cmd: "echo {COMMAND_MARKER}"}});\ntext(r);\n'
"""What the scripted ``exec`` (Codex's code mode: a JavaScript freeform tool) runs."""


def code_mode_exec(body: dict[str, Any]) -> bool:
    """Whether ``body`` offers Codex's code-mode ``exec`` tool (in ``tools`` or an ``additional_tools`` item)."""
    groups: list[list[dict[str, Any]]] = [body.get("tools") or []]
    for item in body.get("input") or []:
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            groups.append(item.get("tools") or [])
    pending = [tool for group in groups for tool in group]
    while pending:
        tool = pending.pop()
        if tool.get("type") == "namespace":
            pending += tool.get("tools") or []
        elif tool.get("type") == "custom" and tool.get("name") == "exec":
            return True
    return False


def scripted_output(body: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The output items answering ``body``: a command call first, a final message after its output."""
    if not _has_tool_output(body) and not body.get("tools") and code_mode_exec(body):
        return [{
            "type": "custom_tool_call", "id": f"ctc_{n}", "call_id": f"call_{n}", "name": "exec",
            "input": CODE_MODE_SOURCE, "status": "completed",
        }]
    call = None if _has_tool_output(body) else command_call(body.get("tools") or [])
    if call is not None:
        name, arguments = call
        return [{
            "type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": name,
            "arguments": arguments, "status": "completed",
        }]
    return [{
        "type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": FINAL_TEXT, "annotations": []}],
    }]


def sse_events(rid: str, model: str, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A minimal valid Responses event stream producing ``output``."""
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": _response(rid, model, "in_progress", [])},
        {"type": "response.in_progress", "response": _response(rid, model, "in_progress", [])},
    ]
    for index, item in enumerate(output):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events += [
                {"type": "response.output_item.added", "output_index": index, "item": {**item, "status": "in_progress", "content": []}},
                {"type": "response.content_part.added", "output_index": index, "item_id": item["id"], "content_index": 0,
                 "part": {"type": "output_text", "text": "", "annotations": []}},
                {"type": "response.output_text.delta", "output_index": index, "item_id": item["id"], "content_index": 0, "delta": text},
                {"type": "response.output_text.done", "output_index": index, "item_id": item["id"], "content_index": 0, "text": text},
                {"type": "response.content_part.done", "output_index": index, "item_id": item["id"], "content_index": 0,
                 "part": item["content"][0]},
            ]
        elif item["type"] == "custom_tool_call":
            events += [
                {"type": "response.output_item.added", "output_index": index, "item": {**item, "status": "in_progress", "input": ""}},
                {"type": "response.custom_tool_call_input.delta", "output_index": index, "item_id": item["id"], "delta": item["input"]},
                {"type": "response.custom_tool_call_input.done", "output_index": index, "item_id": item["id"], "input": item["input"]},
            ]
        else:
            events += [
                {"type": "response.output_item.added", "output_index": index, "item": {**item, "status": "in_progress", "arguments": ""}},
                {"type": "response.function_call_arguments.delta", "output_index": index, "item_id": item["id"], "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", "output_index": index, "item_id": item["id"], "arguments": item["arguments"]},
            ]
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": "response.completed", "response": _response(rid, model, "completed", output)})
    for seq, event in enumerate(events):
        event["sequence_number"] = seq
    return events


async def _record(request: web.Request) -> tuple[CaptureState, Captured]:
    state = request.app[CAPTURE_STATE]
    headers = {name.lower(): value for name, value in request.headers.items()}
    captured = Captured(request.method, request.path, headers, await request.read())
    state.requests.append(captured)
    return state, captured


async def responses(request: web.Request) -> web.StreamResponse:
    state, captured = await _record(request)
    body = captured.json()
    state.counter += 1
    n = state.counter
    rid = f"resp_{n}"
    model = str(body.get("model") or "capture-model")
    output = scripted_output(body, n)
    if not body.get("stream"):
        return web.json_response(_response(rid, model, "completed", output))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for event in sse_events(rid, model, output):
        await response.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
    await response.write_eof()
    return response


async def other(request: web.Request) -> web.Response:
    await _record(request)
    if request.method == "GET" and request.path.endswith("/models"):
        return web.json_response({"object": "list", "data": [], "models": []})
    return web.json_response({"error": {"message": "not found", "type": "invalid_request_error"}}, status=404)


def create_capture_app() -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[CAPTURE_STATE] = CaptureState()
    app.router.add_post("/v1/responses", responses)
    app.router.add_route("*", "/{tail:.*}", other)
    return app


@contextlib.asynccontextmanager
async def running_capture(host: str = "127.0.0.1") -> AsyncIterator[tuple[str, CaptureState]]:
    """Serve the capture upstream while the block runs; yields ``(base URL ending in /v1, state)``."""
    app = create_capture_app()
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, 0)
        await site.start()
        port = runner.addresses[0][1]
        yield f"http://{host}:{port}/v1", app[CAPTURE_STATE]
    finally:
        await runner.cleanup()


FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "responses"

_SECRET_HEADERS = {"authorization"}


def save(name: str, captured: Captured) -> None:
    """Write ``name.json`` (pretty), ``name.raw.json`` (the exact bytes) and ``name.headers.json``."""
    FIXTURES.mkdir(parents=True, exist_ok=True)
    (FIXTURES / f"{name}.raw.json").write_bytes(captured.body)
    (FIXTURES / f"{name}.json").write_text(json.dumps(captured.json(), indent=2, ensure_ascii=False) + "\n")
    headers = {k.lower(): ("<redacted>" if k.lower() in _SECRET_HEADERS else v) for k, v in captured.headers.items()}
    (FIXTURES / f"{name}.headers.json").write_text(
        json.dumps({"method": captured.method, "path": captured.path, "headers": headers}, indent=2) + "\n"
    )


async def capture_codex() -> None:
    from tests.clients.codex import DEFAULT_MODEL, find_codex, run_codex

    if find_codex() is None:
        raise SystemExit("@openai/codex not installed: run .ci/install/codex.sh")
    for prefix, model in (("codex", DEFAULT_MODEL), ("codex_codemode", None)):
        async with running_capture() as (url, state):
            with tempfile.TemporaryDirectory() as tmp:
                run = await run_codex(url, "Run `echo hi` in the shell, then say done.", workdir=Path(tmp), model=model)
            print(run.summary())
            posts = state.responses()
            for other_request in state.requests:
                if other_request not in posts:
                    print("also:", other_request.method, other_request.path)
            for i, captured in enumerate(posts[:2], 1):
                save(f"{prefix}_turn{i}", captured)
            print(f"{prefix}: captured {len(posts)} /responses request(s)")
            if len(posts) >= 2:
                print(json.dumps(compare_turns(posts[0].body, posts[1].body), indent=2))


def compare_turns(first: bytes, second: bytes) -> dict[str, Any]:
    """How the second request re-sends the first: which top-level fields changed, whether the
    first's ``input`` items come back equal, and whether their serialized bytes are a prefix."""
    a, b = json.loads(first), json.loads(second)
    a_items, b_items = a.get("input") or [], b.get("input") or []
    changed = sorted(k for k in set(a) | set(b) if k != "input" and a.get(k) != b.get(k))
    equal_items = len(a_items) <= len(b_items) and b_items[: len(a_items)] == a_items
    # The raw ``input`` array of the first body, without its closing bracket, must open the second's.
    start_a, start_b = first.find(b'"input":['), second.find(b'"input":[')
    end_a = start_a + len(_raw_array(first, start_a + len(b'"input":'))) - 1
    raw_prefix = start_a >= 0 and start_b >= 0 and second[start_b:].startswith(first[start_a:end_a])
    return {
        "changed_fields": changed,
        "first_items": len(a_items),
        "second_items": len(b_items),
        "items_equal": equal_items,
        "items_bytes_prefix": raw_prefix,
        "new_item_types": [i.get("type") for i in b_items[len(a_items):]],
    }


def _raw_array(raw: bytes, start: int) -> bytes:
    """The JSON array beginning at ``raw[start]`` (``[``), as bytes, brackets included."""
    depth, in_string, escaped = 0, False, False
    for index in range(start, len(raw)):
        char = raw[index : index + 1]
        if in_string:
            if escaped:
                escaped = False
            elif char == b"\\":
                escaped = True
            elif char == b'"':
                in_string = False
        elif char == b'"':
            in_string = True
        elif char in (b"[", b"{"):
            depth += 1
        elif char in (b"]", b"}"):
            depth -= 1
            if depth == 0:
                return raw[start : index + 1]
    return raw[start:]


async def capture_agents() -> None:
    from tests.clients.agents import run_agent

    async with running_capture() as (url, state):
        result = await run_agent(url, ["What is the weather in Paris?", "And in Oslo?"])
        print(result.outputs, result.tool_calls)
        posts = state.responses()
        for i, captured in enumerate(posts, 1):
            save(f"agents_turn{i}", captured)
        print(f"captured {len(posts)} /responses request(s)")
        for first, second in itertools.pairwise(posts):
            print(json.dumps(compare_turns(first.body, second.body), indent=2))


def main(argv: list[str]) -> None:
    import asyncio

    which = argv[1] if len(argv) > 1 else ""
    if which == "codex":
        asyncio.run(capture_codex())
    elif which == "agents":
        asyncio.run(capture_agents())
    else:
        raise SystemExit("usage: python -m tests.clients.capture codex|agents")


if __name__ == "__main__":
    main(sys.argv)
