"""The SSE decoder: raw fidelity, WHATWG field rules, and independence from chunking."""

from __future__ import annotations

import json
import re

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.core.guard import STRICT
from proxy.core.sse import SSEDecoder, SSEEvent, load_data
from proxy.transport.traits import UpstreamTraits
from proxy.wire.chat import ChatObserver


def decode(chunks: list[bytes]) -> list[SSEEvent]:
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events.extend(decoder.feed(chunk))
    events.extend(decoder.flush())
    return events


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(max(c, 0), len(data)) for c in cuts})
    chunks, last = [], 0
    for point in points:
        chunks.append(data[last:point])
        last = point
    chunks.append(data[last:])
    return chunks


_LINE = re.compile(rb"([^\r\n]*)(\r\n|\r|\n|$)")


def reference(stream: bytes) -> list[tuple[bytes, str | None, str | None]]:
    """A plain line-by-line reading of the WHATWG rules, independent of the decoder's scanning."""
    events = []
    start = 0
    data: list[str] | None = None
    event: str | None = None
    pos = 0
    first = True
    while pos < len(stream):
        match = _LINE.match(stream, pos)
        assert match is not None
        line, end = match.group(1), match.end()
        pos = end
        if first and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        first = False
        if line == b"" and match.group(2):
            events.append((stream[start:pos], None if data is None else "\n".join(data), event))
            start, data, event = pos, None, None
            continue
        if line.startswith(b":"):
            continue
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data = [*(data or []), value.decode()]
        elif name == b"event":
            event = value.decode() or None
    if start < len(stream):
        events.append((stream[start:], None if data is None else "\n".join(data), event))
    return events


def triples(events: list[SSEEvent]) -> list[tuple[bytes, str | None, str | None]]:
    return [(e.raw, e.data, e.event) for e in events]


def general(stream: bytes) -> list[SSEEvent]:
    """``stream`` decoded by the general reading alone (fed a byte at a time, no chunk is ever
    a whole event), every field."""
    return decode(split_at(stream, list(range(1, len(stream)))))


OPENAI_STREAM = (
    b": OPENROUTER PROCESSING\n\n"
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"lo \\u00e9\xe2\x82\xac"},"finish_reason":"stop"}]}\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\n'
    b"data: [DONE]\n\n"
)


def test_openai_stream_events_and_raw() -> None:
    events = decode([OPENAI_STREAM])
    assert [e.data is None for e in events] == [True, False, False, False, False, False]
    assert b"".join(e.raw for e in events) == OPENAI_STREAM
    assert events[0].raw == b": OPENROUTER PROCESSING\n\n"
    assert json.loads(events[3].data or "")["choices"][0]["delta"]["content"] == "lo é€"
    assert events[-1].data == "[DONE]"
    assert all(e.event is None for e in events)


def test_every_single_split_of_a_crlf_stream_gives_the_same_events() -> None:
    stream = OPENAI_STREAM.replace(b"\n", b"\r\n") + b"event: error\r\ndata: {}\r\n\r\n"
    whole = triples(decode([stream]))
    assert len(whole) == 7 and whole[-1][2] == "error"
    for cut in range(len(stream) + 1):
        assert triples(decode([stream[:cut], stream[cut:]])) == whole, cut
    assert triples(decode([bytes([b]) for b in stream])) == whole


def test_lone_cr_at_chunk_end_waits_for_a_possible_lf() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r\r") == []  # the last "\r" may be half of "\r\n"
    events = decoder.feed(b"\ndata: b\r\r")
    assert [e.raw for e in events] == [b"data: a\r\r\n"]
    assert decoder.feed(b"x") == [SSEEvent(raw=b"data: b\r\r", payload=b"b", event=None)]
    assert [e.raw for e in decoder.flush()] == [b"x"]


def test_mixed_line_endings_end_events_at_the_first_blank_line() -> None:
    stream = b"data: 1\n\r\ndata: 2\r\n\ndata: 3\r\rdata: 4\n\rdata: 5\r\n\r\n"
    events = decode([stream])
    assert [e.data for e in events] == ["1", "2", "3", "4", "5"]
    assert [e.raw for e in events] == [
        b"data: 1\n\r\n",
        b"data: 2\r\n\n",
        b"data: 3\r\r",
        b"data: 4\n\r",
        b"data: 5\r\n\r\n",
    ]


def test_field_rules() -> None:
    stream = (
        b"data:no-space\ndata:  two\ndata\n: comment\nid: 7\nretry: 1500\nevent: delta\n"
        b"unknown: x\n\n"
    )
    (event,) = decode([stream])
    assert event.data == "no-space\n two\n"
    assert event.event == "delta"
    assert event.id == "7"
    assert event.retry == 1500


def test_comment_only_event_has_no_data_and_empty_data_is_empty_string() -> None:
    events = decode([b": keep-alive\n\ndata:\n\n"])
    assert events[0].data is None
    assert events[1].data == ""


def test_flush_returns_an_unterminated_remainder() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"a":1}\n\ndata: [DONE]') == [
        SSEEvent(raw=b'data: {"a":1}\n\n', payload=b'{"a":1}', event=None)
    ]
    assert decoder.flush() == [SSEEvent(raw=b"data: [DONE]", payload=b"[DONE]", event=None)]
    assert decoder.flush() == []
    assert decoder.feed(b"") == []


def test_bom_is_ignored_for_parsing_but_kept_in_raw() -> None:
    stream = b"\xef\xbb\xbfdata: x\n\n\xef\xbb\xbfdata: y\n\n"
    events = decode([stream[:1], stream[1:]])
    assert events[0].data == "x"
    assert events[0].raw.startswith(b"\xef\xbb\xbf")
    # Only the stream's first BOM is special; a later one is part of a field name.
    assert events[1].data is None


def test_invalid_utf8_is_replaced_not_raised() -> None:
    (event,) = decode([b"data: \xff\xfe\n\n"])
    assert event.data == "\ufffd\ufffd"


def test_large_event_split_into_many_chunks() -> None:
    payload = b"data: " + b"x" * 200_000 + b"\n\n"
    chunks = [payload[i : i + 1000] for i in range(0, len(payload), 1000)]
    (event,) = decode(chunks)
    assert event.raw == payload and len(event.data or "") == 200_000


# --- chunking independence --------------------------------------------------------------

_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=20
)
_line = st.one_of(
    _text.map(lambda t: "data: " + t),
    _text.map(lambda t: "data:" + t),
    st.just("data"),
    st.sampled_from(["event: message", "event: error", "id: 42", "retry: 3000", "event:"]),
    _text.map(lambda t: ":" + t),
    st.builds(lambda c: "data: " + json.dumps({"choices": [{"delta": {"content": c}}]}), _text),
)
_eol = st.sampled_from(["\n", "\r\n", "\r"])


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    mixed = draw(st.booleans())
    fixed = draw(_eol)
    out = []
    for _ in range(draw(st.integers(0, 6))):
        for line in draw(st.lists(_line, min_size=0, max_size=4)):
            out.append(line + (draw(_eol) if mixed else fixed))
        out.append(draw(_eol) if mixed else fixed)
    if draw(st.booleans()):  # an unterminated tail
        out.append(draw(_line))
        if draw(st.booleans()):
            out.append(draw(_eol) if mixed else fixed)
    return "".join(out).encode()


@settings(max_examples=400, deadline=None)
@given(stream=streams(), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_decoding_is_independent_of_chunking(stream: bytes, cuts: list[int]) -> None:
    one_shot = decode([stream])
    chunked = decode(split_at(stream, cuts))
    assert triples(chunked) == triples(one_shot) == reference(stream)
    assert b"".join(e.raw for e in chunked) == stream


@settings(max_examples=200, deadline=None)
@given(stream=st.binary(max_size=200), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_arbitrary_bytes_round_trip(stream: bytes, cuts: list[int]) -> None:
    chunked = decode(split_at(stream, cuts))
    assert b"".join(e.raw for e in chunked) == stream
    assert [e.raw for e in chunked] == [e.raw for e in decode([stream])]


@settings(max_examples=400, deadline=None)
@given(stream=streams())
def test_a_live_stream_one_event_per_chunk_decodes_as_one_shot(stream: bytes) -> None:
    """Live streams arrive an event per chunk (a token each): those chunks are read in place,
    and give what one-shot decoding, the general reading and the plain reading of the rules
    give, every field included."""
    one_shot = decode([stream])
    per_event = decode([e.raw for e in one_shot])
    assert per_event == one_shot == general(stream)
    assert triples(per_event) == reference(stream)


@settings(max_examples=400, deadline=None)
@given(stream=streams(), groups=st.lists(st.integers(1, 4), max_size=12))
@example(stream=b"data: 0\n\ndata: 1\n\nid: 2\ndata: 2\n\ndata: 3\n\n", groups=[1, 3])
def test_a_live_stream_several_events_per_chunk_decodes_as_one_shot(stream: bytes, groups: list[int]) -> None:
    """A reader that fell behind gets several whole events in one chunk (the transport hands
    over everything that arrived): the same events, every field included."""
    one_shot = decode([stream])
    raws, chunks = [e.raw for e in one_shot], []
    for size in groups:
        chunks.append(b"".join(raws[:size]))
        raws = raws[size:]
    chunks.append(b"".join(raws))
    grouped = decode(chunks)
    assert grouped == one_shot == general(stream)
    assert triples(grouped) == reference(stream)


def test_a_whole_stream_in_one_chunk_is_read_in_place_from_its_first_event() -> None:
    """It must be able to fail: a short answer arrives whole in the proxy's first read; only a
    byte-order mark (or a shape the in-place reading declines) sends it to the general reading."""
    stream = b"".join([b"event: response.created\ndata: {}\n\n", *(b'data: {"n":%d}\n\n' % i for i in range(5))])
    whole = SSEDecoder()
    events = whole.feed(stream) + whole.flush()
    assert events == general(stream) and len(events) == 6
    assert whole.general_reads == 0
    byte_by_byte = SSEDecoder()
    for byte in split_at(stream, list(range(1, len(stream)))):
        byte_by_byte.feed(byte)
    byte_by_byte.flush()
    assert byte_by_byte.general_reads == 6
    marked = SSEDecoder()
    events = marked.feed(b"\xef\xbb\xbf" + stream) + marked.flush()
    assert [e.data for e in events][:2] == ["{}", '{"n":0}'] and events[0].raw.startswith(b"\xef\xbb\xbf")
    assert marked.general_reads >= 1


def test_whole_events_reads_a_chunk_of_live_events_and_leaves_the_rest_from_the_first_it_declines() -> None:
    """It must be able to fail: a chunk of typical events is read whole, without the general
    reading; from an event of another shape, the bytes are left to it."""
    from proxy.core import sse

    typical = [b'data: {"a":1}\n\n', b"event: response.output_text.delta\ndata: {}\n\n", b"data:\n\n"]
    events, rest = sse._whole_events(b"".join(typical))
    assert (events, rest) == ([sse._parse(c, c) for c in typical], 0)
    declined = b": ping\n\n" + typical[0]
    events, rest = sse._whole_events(typical[0] + typical[1] + declined)
    assert (events, rest) == ([sse._parse(c, c) for c in typical[:2]], len(declined))
    assert sse._whole_events(typical[0] + b"data: x") == ([sse._parse(typical[0], typical[0])], len(b"data: x"))


def test_the_in_place_path_is_taken_for_live_chunks() -> None:
    """It must be able to fail: typical chunks are read in place, exactly as the general reading
    reads them; other shapes are declined whole."""
    from proxy.core import sse

    chunks = [
        b'data: {"a":1}\n\n', b"event: response.output_text.delta\ndata: {}\n\n", b"event:\ndata:x\n\n",
        b"data:\n\n", b"event: \ndata:  two spaces\n\n", b"event:x\ndata: \xff\n\n",
    ]
    for chunk in chunks:
        assert sse._whole_events(chunk) == ([sse._parse(chunk, chunk)], 0)
    declined = (
        b"id: 1\ndata: x\n\n", b"data: a\ndata: b\n\n", b"data: x\r\n\r\n", b": ping\n\n", b"data: x\n",
        b"event: x\n\ndata: y\n\n", b"event: x\nid: 2\n\n", b"\ndata: x\n\n", b"event: a\ndata: b\n", b"data: x\n y\n\n",
    )
    for chunk in declined:
        assert sse._whole_events(chunk) == ([], len(chunk))


def test_an_events_data_is_read_from_its_bytes_and_invalid_utf8_as_its_text() -> None:
    """Observers parse an event's bytes (``payload``); data that is not valid UTF-8 is read as
    its text with replacement characters (``data``), as it was when every event was decoded:
    a stream's usage is not lost to a stray byte."""
    raw = b'{"usage": {"prompt_tokens": 3, "completion_tokens": 1}, "note": "caf\xe9"}'
    assert load_data(raw) == orjson.loads(raw.decode("utf-8", "replace"))
    for not_json in (b"not json", "pas du jsön".encode(), b"\xff\xfe"):
        with pytest.raises(orjson.JSONDecodeError):
            load_data(not_json)
    (event,) = SSEDecoder().feed(b"data: " + raw + b"\n\n")
    assert event.payload == raw and event.data == raw.decode("utf-8", "replace")
    observer = ChatObserver(False, UpstreamTraits(), STRICT, success=True)
    observer.on_event(event)
    assert observer.usage is not None and observer.usage.prompt_tokens == 3
