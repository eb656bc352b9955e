"""The Responses observer reads what a stream delivered: usage and output from the terminal
event; the item and delta events only when the stream ends without the output (cut by the
client, the upstream, or ``response.incomplete``). Events named by their ``event:`` line are
read that lazily; a server that names none is read event by event: both give the same reply."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest

from proxy.core.record import Reply
from proxy.core.sse import SSEDecoder, SSEEvent
from proxy.request.failopen import FailOpen
from proxy.sim.events import response_events
from proxy.wire.responses import ResponsesObserver

TEXT = "The cache broke at the system prompt: its timestamp changed between turns, so pin it."
ARGS = '{"path":"src/cache.py","lines":[1,40]}'
USAGE = {"input_tokens": 900, "input_tokens_details": {"cached_tokens": 768}, "output_tokens": 40,
         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 940}


def completed(status: str = "completed") -> dict[str, Any]:
    return {
        "id": "resp_1", "object": "response", "created_at": 0, "status": status, "model": "m",
        "output": [
            {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": TEXT, "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "read_file", "arguments": ARGS,
             "status": "completed"},
        ],
        "usage": USAGE,
    }


def stream(named: bool, final: dict[str, Any] | None = None) -> list[SSEEvent]:
    """The events of ``final`` as the upstream sends them (without ``event:`` lines: unnamed)."""
    final = final or completed()
    raw = b"".join(response_events({**final, "status": "in_progress", "output": [], "usage": None}, final))
    if not named:
        raw = re.sub(rb"(?m)^event: [^\n]*\n", b"", raw)
    events = SSEDecoder().feed(raw)
    assert all((e.event is not None) is named for e in events)
    return events


def observe(events: list[SSEEvent], *, client_gone: bool = False) -> tuple[Reply | None, ResponsesObserver, FailOpen]:
    guard = FailOpen()
    observer = ResponsesObserver(guard, success=True)
    for event in events:
        observer.on_event(event)
        if observer.is_terminal(event):
            break
    return observer.end(client_gone=client_gone), observer, guard


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_a_completed_stream_gives_its_output_and_usage(named: bool) -> None:
    reply, observer, guard = observe(stream(named))
    assert reply is not None and not reply.partial
    message, call = reply.messages
    assert message["content"] == [{"type": "text", "text": TEXT}]
    assert call["tool_calls"][0]["function"] == {"name": "read_file", "arguments": ARGS}
    assert observer.usage is not None and observer.usage.prompt_tokens == 900 and observer.usage.cached_tokens == 768
    assert guard.failed == []


def test_a_stream_cut_anywhere_is_assembled_the_same_whether_its_events_are_named_or_not() -> None:
    named, unnamed = stream(True), stream(False)
    assert len(named) == len(unnamed) > 20
    seen_partial = 0
    for cut in range(1, len(named)):  # the last event is response.completed
        lazy, _, lazy_guard = observe(named[:cut], client_gone=True)
        eager, _, eager_guard = observe(unnamed[:cut], client_gone=True)
        assert lazy == eager, cut
        assert lazy_guard.failed == eager_guard.failed == []
        if lazy is not None:
            seen_partial += 1
            assert lazy.partial
    assert seen_partial > 10


def test_a_cut_message_keeps_the_text_delivered_and_a_cut_call_its_arguments_so_far() -> None:
    events = stream(True)
    kinds = [e.event for e in events]
    # Mid-message: after a few text deltas.
    mid_text = kinds.index("response.output_text.delta") + 3
    reply, _, _ = observe(events[:mid_text], client_gone=True)
    assert reply is not None and reply.partial
    (message,) = reply.messages
    delivered = "".join(orjson.loads(e.data)["delta"] for e in events[:mid_text] if e.event == "response.output_text.delta")
    assert delivered and TEXT.startswith(delivered) and delivered != TEXT
    assert message["content"] == [{"type": "text", "text": delivered}]
    # Mid-call: the message is done, the call has part of its arguments.
    mid_call = kinds.index("response.function_call_arguments.delta") + 2
    reply, _, _ = observe(events[:mid_call], client_gone=True)
    assert reply is not None and len(reply.messages) == 2
    so_far = "".join(orjson.loads(e.data)["delta"] for e in events[:mid_call] if e.event == "response.function_call_arguments.delta")
    assert so_far and ARGS.startswith(so_far) and so_far != ARGS
    assert reply.messages[1]["tool_calls"][0]["function"] == {"name": "read_file", "arguments": so_far}


def test_an_incomplete_response_without_its_output_is_assembled_from_the_item_events() -> None:
    final = completed("incomplete")
    events = stream(True, final)
    last = events[-1]
    assert last.event == "response.incomplete" or last.event == "response.completed"
    # The terminal event as a provider that stops early sends it: its status, no output.
    data = orjson.loads(last.data or "")
    data["type"] = "response.incomplete"
    data["response"] = {**data["response"], "status": "incomplete", "output": []}
    events[-1] = SSEDecoder().feed(b"event: response.incomplete\ndata: " + orjson.dumps(data) + b"\n\n")[0]
    reply, observer, guard = observe(events)
    assert reply is not None and reply.partial  # assembled from its items: what was generated of it
    message, call = reply.messages
    assert message["content"] == [{"type": "text", "text": TEXT}]
    assert call["tool_calls"][0]["function"] == {"name": "read_file", "arguments": ARGS}
    assert observer.usage is not None and observer.usage.prompt_tokens == 900
    assert guard.failed == []


def test_a_broken_item_event_costs_only_itself_when_its_output_must_be_assembled() -> None:
    events = stream(True)
    kinds = [e.event for e in events]
    at = kinds.index("response.output_text.delta") + 1
    broken = SSEDecoder().feed(b"event: response.output_text.delta\ndata: {not json\n\n")[0]
    cut = [*events[:at], broken, *events[at : kinds.index("response.function_call_arguments.delta") + 1]]
    reply, _, guard = observe(cut, client_gone=True)
    assert guard.failed == ["usage"]
    assert reply is not None and len(reply.messages) == 2  # the items around it were kept
    # The same broken event in a stream that completes is never read: nothing fails.
    whole = [*events[:at], broken, *events[at:]]
    reply, _, guard = observe(whole)
    assert guard.failed == [] and reply is not None and not reply.partial
