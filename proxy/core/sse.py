"""Incremental decoder for ``text/event-stream`` (Server-Sent Events).

The proxy relays a streamed response event by event: it writes each
:attr:`SSEEvent.raw` to the client as soon as the event is complete, and reads
:attr:`SSEEvent.payload` on the side (reply assembly, usage; :func:`load_data`). So the decoder owns
two promises:

* **raw fidelity** — the ``raw`` of every event is the exact input bytes of
  that event, terminating blank line included; concatenating ``raw`` over all
  events returned by :meth:`SSEDecoder.feed` and :meth:`SSEDecoder.flush`
  gives back the input, byte for byte;
* **chunking independence** — the events do not depend on how the transport
  split the bytes.

Parsing follows the WHATWG rules: lines end with ``\\r\\n``, ``\\n`` or
``\\r``; an event ends at a blank line; ``field: value`` with one optional
space after the colon; a line without a colon is a field with an empty value;
lines starting with ``:`` are comments; ``data`` lines are joined with
``\\n``; a UTF-8 BOM at the start of the stream is ignored. Unlike a browser,
the unterminated remainder at end of stream is returned as a final event
(upstreams that close without the last blank line still deliver their usage).

This is the hot path of streaming: event boundaries are found with
``bytes.find`` (or, once the stream has shown a ``\\r``, one compiled regex),
never by a per-byte Python loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

import orjson

__all__ = ["SSEDecoder", "SSEEvent", "load_data"]

_BOM = b"\xef\xbb\xbf"

# A line terminator followed by another one ends an event. A lone "\r" must not
# be the first half of a "\r\n" pair, or "x\r\n" would read as two line ends.
_BOUNDARY = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")
# The longest boundary is 4 bytes; a search resumed this far before the old end
# of the buffer finds every boundary that the new bytes could complete.
_RESCAN = 3


@dataclass(init=False, unsafe_hash=True)  # built per stream event (proxy/core/values.py)
class SSEEvent:
    """One event of a stream, with the exact bytes it was made of."""

    raw: Final[bytes]
    """The input bytes of this event, including its terminating blank line."""
    payload: Final[bytes | None]
    """The ``data`` lines joined with ``\\n``, as bytes; ``None`` when the event has no ``data``
    field. What an observer parses (``orjson`` reads bytes): decoding every event's data to
    text would decode the many events no observer reads."""
    event: Final[str | None]
    """The ``event`` field (the event type); ``None`` when absent or empty."""
    id: Final[str | None]
    """The ``id`` field, when present (ignored if it contains NUL, as the spec says)."""
    retry: Final[int | None]
    """The ``retry`` field, when it is all ASCII digits."""

    def __init__(
        self,
        *,
        raw: bytes,
        payload: bytes | None,
        event: str | None,
        id: str | None = None,
        retry: int | None = None,
    ) -> None:
        self.raw = raw
        self.payload = payload
        self.event = event
        self.id = id
        self.retry = retry

    @property
    def data(self) -> str | None:
        """:attr:`payload` as text (invalid UTF-8 replaced), decoded at each read."""
        payload = self.payload
        return None if payload is None else payload.decode("utf-8", "replace")


def load_data(data: bytes) -> Any:
    """``orjson.loads`` of an event's data (:attr:`SSEEvent.payload`, or one kept aside), read
    as its text would be when it is not valid UTF-8: with replacement characters. Raises
    ``orjson.JSONDecodeError``."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return orjson.loads(data.decode("utf-8", "replace"))
        raise  # valid UTF-8: its text is no JSON either


class SSEDecoder:
    """Split a byte stream into :class:`SSEEvent` values; feed chunks, then flush at the end."""

    __slots__ = ("_buf", "_cr", "_first", "_scan", "general_reads")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._scan = 0
        """Offset in ``_buf`` from which the next boundary search starts."""
        self._cr = False
        """The stream has shown a ``\\r``: use the general boundary regex from now on."""
        self._first = True
        """The next event is the first of the stream (a leading BOM is ignored)."""
        self.general_reads = 0
        """Events read line by line, not in place: shapes the in-place reading declines (a
        ``\\r``, a comment, ``id`` or ``retry`` fields, an event split across reads)."""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Add ``chunk`` and return the events it completed; partial bytes are kept."""
        if not chunk:
            return []
        if self._first and not self._buf and chunk[0] != _BOM[0]:
            self._first = False  # no byte-order mark: the first event is read as any other
        if not self._buf and not self._first and not self._cr:
            # A live stream's chunk: one whole event (a token), or several (a reader that fell
            # behind, a short answer that arrived whole).
            events, rest = _whole_events(chunk)
            if not rest:
                return events
            chunk = chunk[len(chunk) - rest :]
        else:
            events = []
        buf = self._buf
        buf += chunk
        if not self._cr and b"\r" in chunk:
            self._cr = True
        size = len(buf)
        start = 0
        scan = self._scan
        while True:
            # A blank line at the start of an event is an (empty) event of its own, so a
            # bare-newline keep-alive is relayed at once instead of riding on the next event.
            lead = self._leading_blank_line(buf, start, size)
            if lead < 0:
                scan = start
                break
            if lead:
                end = start + lead
            elif not self._cr:
                # The common case: LF-only streams, one C-level scan per boundary.
                pos = buf.find(b"\n\n", scan)
                if pos < 0:
                    scan = max(start, size - 1)
                    break
                end = pos + 2
            else:
                match = _BOUNDARY.search(buf, scan)
                if match is None:
                    scan = max(start, size - _RESCAN)
                    break
                end = match.end()
                if end == size and buf[end - 1] == 0x0D:
                    # A final "\r" may be the first half of "\r\n": wait for the next byte.
                    scan = match.start()
                    break
            events.append(self._event(bytes(buf[start:end])))
            start = scan = end
        if start:
            del buf[:start]
            scan -= start
        self._scan = scan
        return events

    def flush(self) -> list[SSEEvent]:
        """End of stream: return the remainder as a final event when it is not empty."""
        if not self._buf:
            return []
        raw = bytes(self._buf)
        self._buf.clear()
        self._scan = 0
        return [self._event(raw)]

    def _leading_blank_line(self, buf: bytearray, start: int, size: int) -> int:
        """Length of a line terminator at ``start`` (after the stream's BOM); -1: wait for a byte."""
        pos = start
        if self._first and buf.startswith(_BOM, start):
            pos += len(_BOM)
        if pos >= size:
            return 0
        byte = buf[pos]
        if byte == 0x0A:
            return pos + 1 - start
        if byte == 0x0D:
            if pos + 1 >= size:
                return -1
            return pos + (2 if buf[pos + 1] == 0x0A else 1) - start
        return 0

    def _event(self, raw: bytes) -> SSEEvent:
        self.general_reads += 1
        body = raw
        if self._first:
            self._first = False
            if body.startswith(_BOM):
                body = body[len(_BOM) :]
        return _parse(raw, body)


def _whole_events(chunk: bytes) -> tuple[list[SSEEvent], int]:
    """The events at the start of ``chunk`` that are each exactly ``data: ...``, or ``event:
    ...`` then ``data: ...``, LF-terminated, then a blank line (what :func:`_parse` reads from
    them), read in place; and how many bytes are left, from the first event of another shape,
    for the general reading.

    The chunk is split into lines once (one C call, memchr speed); each event is then read
    with indexing and slicing, which compiled code does inline, where searching for each line
    end with ``bytes.find`` and testing prefixes with ``startswith`` would cost four method
    calls per event."""
    events: list[SSEEvent] = []
    size = len(chunk)
    if b"\r" in chunk:
        return events, size
    lines = chunk.split(b"\n")
    complete = len(lines) - 1  # lines[j] is followed by a line feed when j < complete
    start = 0
    i = 0
    while i < complete:
        first = lines[i]
        second = lines[i + 1]
        if not second:
            if i + 1 >= complete:
                break  # the chunk ends just after this line: its blank line has not arrived
            # one line, then the blank line
            event: str | None = None
            data_line = first
            after = start + len(first) + 2
            step = 2
        else:
            if first[:6] != b"event:" or i + 2 >= complete or lines[i + 2]:
                break  # another shape, or the blank line has not arrived
            name = 6
            if name < len(first) and first[name] == 0x20:
                name += 1
            event = first[name:].decode("utf-8", "replace") if name < len(first) else None
            data_line = second
            after = start + len(first) + len(second) + 3
            step = 3
        if data_line[:5] != b"data:":
            break
        data = 5
        if data < len(data_line) and data_line[data] == 0x20:
            data += 1
        events.append(SSEEvent(raw=chunk[start:after], payload=data_line[data:], event=event))
        start = after
        i += step
    return events, size - start


def _parse(raw: bytes, body: bytes) -> SSEEvent:
    """Read the fields of one event; ``body`` is ``raw`` less a leading BOM."""
    data: list[bytes] | None = None
    event: bytes | None = None
    ident: bytes | None = None
    retry: int | None = None
    # bytes.splitlines breaks at exactly "\r\n", "\n" and "\r", as SSE requires.
    for line in body.splitlines():
        if not line or line[0] == 0x3A:  # blank line or ":" comment
            continue
        colon = line.find(b":")
        if colon < 0:
            name, value = line, b""
        else:
            name, value = line[:colon], line[colon + 1 :]
            if value[:1] == b" ":
                value = value[1:]
        if name == b"data":
            if data is None:
                data = [value]
            else:
                data.append(value)
        elif name == b"event":
            event = value
        elif name == b"id":
            if b"\x00" not in value:
                ident = value
        elif name == b"retry":
            if value.isdigit():
                retry = int(value)
    return SSEEvent(
        raw=raw,
        payload=None if data is None else b"\n".join(data),
        event=event.decode("utf-8", "replace") if event else None,
        id=None if ident is None else ident.decode("utf-8", "replace"),
        retry=retry,
    )
