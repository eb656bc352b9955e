"""The Messages observer: the reply as generated and the usage, from a body or from Anthropic's events.

The events are the reference upstream's (``proxy/sim/message_events.py``: Anthropic's order and
shapes). A stream gives the same reply as the body of the same message; a stream cut anywhere
gives the blocks as delivered, the one in flight with its deltas so far; ``message_delta``'s
cumulative usage is read once, whatever it repeats.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.core.record import Reply
from proxy.core.sse import SSEDecoder, SSEEvent
from proxy.request.failopen import FailOpen
from proxy.sim.message_events import message_events, message_object
from proxy.wire.messages import MessagesObserver
from proxy.wire.messages_view import assistant_view

THINKING = "The cache key is computed in src/cache.py; read it first."
TEXT = "Reading the file now.\n"
INPUT = {"path": "src/cache.py", "start_line": 1, "encoding": "utf-8", "note": "café ☕"}
USAGE = {
    "input_tokens": 12, "cache_creation_input_tokens": 1500, "cache_read_input_tokens": 2048,
    "cache_creation": {"ephemeral_5m_input_tokens": 1000, "ephemeral_1h_input_tokens": 500},
    "output_tokens": 60, "service_tier": "standard",
}


def message(content: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    blocks = content if content is not None else [
        {"type": "thinking", "thinking": THINKING, "signature": "c2lnbmVk"},
        {"type": "text", "text": TEXT},
        {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": INPUT},
    ]
    return message_object(message_id="msg_1", model="claude-sim", content=blocks, stop_reason="tool_use", usage=USAGE)


def events(msg: dict[str, Any] | None = None) -> list[SSEEvent]:
    return SSEDecoder().feed(b"".join(message_events(msg or message())))


def observe(stream: list[SSEEvent], *, client_gone: bool = False) -> tuple[Reply | None, MessagesObserver, FailOpen]:
    guard = FailOpen()
    observer = MessagesObserver(guard, success=True)
    for event in stream:
        observer.on_event(event)
    return observer.end(client_gone=client_gone), observer, guard


def test_a_stream_and_a_body_give_the_same_reply_and_usage() -> None:
    streamed, stream_observer, guard = observe(events())
    body_observer = MessagesObserver(FailOpen(), success=True)
    body_observer.on_body(orjson.dumps(message()))
    whole = body_observer.end(client_gone=False)
    assert streamed is not None and whole is not None
    assert streamed.message == whole.message
    assert orjson.dumps(streamed.message) == orjson.dumps(whole.message)
    assert not streamed.partial and streamed.finish_reason == "tool_use" and streamed.model == "claude-sim"
    view = streamed.message
    assert view["content"] == [{"type": "text", "text": TEXT}]
    assert view["thinking_blocks"] == [{"signature": "c2lnbmVk", "thinking": THINKING, "type": "thinking"}]
    # The input as generated: the compact JSON of its pieces, keys in the order generated.
    assert view["tool_calls"][0]["function"]["arguments"] == orjson.dumps(INPUT).decode()
    for usage in (stream_observer.usage, body_observer.usage):
        assert usage is not None
        assert usage.prompt_tokens == 12 + 1500 + 2048  # input + writes + reads
        assert usage.cached_tokens == 2048 and usage.completion_tokens == 60
        assert usage.cache_write_tokens == 1500
        assert (usage.cache_write_5m_tokens, usage.cache_write_1h_tokens) == (1000, 500)
    assert guard.failed == []


def test_a_reply_echoed_by_the_sdk_has_the_view_kvwarm_recorded() -> None:
    """What the ``anthropic`` SDK sends back (``model_dump`` of its blocks, ``None`` fields and all)
    is viewed as the reply kvwarm assembled."""
    import anthropic

    reply, _, _ = observe(events())
    assert reply is not None
    parsed = anthropic.types.Message.model_validate(message())
    for blocks in ([b.model_dump() for b in parsed.content], [b.model_dump(exclude_none=True) for b in parsed.content]):
        assert orjson.dumps(assistant_view(blocks, {})) == orjson.dumps(reply.message)


def test_message_delta_repeating_the_input_counts_counts_them_once() -> None:
    raw = b"".join(message_events(message()))
    # Anthropic's message_delta usage is cumulative; newer servers repeat every input count in it.
    assert b'"type":"message_delta"' in raw
    stream = SSEDecoder().feed(raw)
    _, observer, _ = observe(stream)
    once = observer.usage
    doubled = [*stream[:-1], *[e for e in stream if e.event == "message_delta"], stream[-1]]
    _, again, _ = observe(doubled)
    assert again.usage == once


def test_only_output_tokens_in_message_delta_keep_the_input_counts() -> None:
    stream = events()
    trimmed: list[SSEEvent] = []
    for event in stream:
        if event.event == "message_delta":
            payload = orjson.loads(event.payload or b"")
            payload["usage"] = {"output_tokens": 61}
            event = SSEDecoder().feed(b"event: message_delta\ndata: " + orjson.dumps(payload) + b"\n\n")[0]
        trimmed.append(event)
    _, observer, _ = observe(trimmed)
    assert observer.usage is not None
    assert observer.usage.prompt_tokens == 12 + 1500 + 2048 and observer.usage.completion_tokens == 61


def test_a_stream_cut_anywhere_is_recorded_as_delivered() -> None:
    stream = events()
    whole, _, _ = observe(stream)
    assert whole is not None
    seen: set[bytes] = set()
    for cut in range(1, len(stream)):
        reply, _, guard = observe(stream[:cut], client_gone=True)
        assert guard.failed == []
        if reply is None:
            continue
        assert reply.partial
        seen.add(orjson.dumps(reply.message))
        texts = reply.message.get("content") or []
        for part in texts:
            assert TEXT.startswith(part["text"])
        for call in reply.message.get("tool_calls") or []:
            arguments = call["function"]["arguments"]
            assert arguments == "{}" or orjson.dumps(INPUT).decode().startswith(arguments)
    assert len(seen) > 5  # the thinking, the text and the input grew delta by delta


@pytest.mark.parametrize("stop", ["message_delta", "message_stop"])
def test_a_stream_without_message_stop_is_partial(stop: str) -> None:
    stream = events()
    cut = next(i for i, e in enumerate(stream) if e.event == stop)
    reply, _, _ = observe(stream[:cut])
    assert reply is not None and reply.partial
    reply, _, _ = observe(stream)
    assert reply is not None and not reply.partial


def test_an_empty_input_is_an_empty_object() -> None:
    msg = message([{"type": "tool_use", "id": "toolu_2", "name": "list", "input": {}}])
    reply, _, _ = observe(events(msg))
    assert reply is not None
    assert reply.message["tool_calls"][0]["function"]["arguments"] == "{}"


def test_a_failed_response_is_not_read() -> None:
    observer = MessagesObserver(FailOpen(), success=False)
    observer.on_body(orjson.dumps({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}))
    assert observer.end(client_gone=False) is None and observer.usage is None


def test_citations_and_server_tool_blocks_are_recorded_as_the_sdk_sends_them_back() -> None:
    """A text block's citations arrive as ``citations_delta`` events, a server tool's input as
    ``input_json_delta`` pieces: the recorded reply is the view of the blocks the SDK assembles."""
    import anthropic

    citation = {"type": "char_location", "cited_text": "cache", "document_index": 0, "document_title": None,
                "start_char_index": 0, "end_char_index": 5, "file_id": None}
    search = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "kv cache"}}
    msg = message([search, {"type": "text", "text": TEXT, "citations": [citation]}])
    raw = b""
    for event in message_events(msg):
        payload = orjson.loads(event.split(b"data: ", 1)[1])
        if payload["type"] == "content_block_start" and payload["content_block"]["type"] == "text":
            payload["content_block"]["citations"] = None
            raw += b"event: content_block_start\ndata: " + orjson.dumps(payload) + b"\n\n"
            delta = {"type": "content_block_delta", "index": payload["index"], "delta": {"type": "citations_delta", "citation": citation}}
            raw += b"event: content_block_delta\ndata: " + orjson.dumps(delta) + b"\n\n"
        elif payload["type"] == "content_block_start" and payload["content_block"]["type"] == "server_tool_use":
            payload["content_block"]["input"] = {}
            raw += b"event: content_block_start\ndata: " + orjson.dumps(payload) + b"\n\n"
            for piece in ('{"query"', ': "kv cache"}'):
                delta = {"type": "content_block_delta", "index": payload["index"], "delta": {"type": "input_json_delta", "partial_json": piece}}
                raw += b"event: content_block_delta\ndata: " + orjson.dumps(delta) + b"\n\n"
        else:
            raw += event
    reply, _, guard = observe(SSEDecoder().feed(raw))
    assert reply is not None and guard.failed == []
    parsed = anthropic.types.Message.model_validate(msg)
    for blocks in ([b.model_dump() for b in parsed.content], [b.model_dump(exclude_none=True) for b in parsed.content]):
        assert orjson.dumps(assistant_view(blocks, {})) == orjson.dumps(reply.message)
