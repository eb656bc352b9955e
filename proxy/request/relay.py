"""Relaying an upstream response to the client as it arrives, through the response's observer.

A :class:`Relay` runs in two steps, so the caller can record the turn in between:
:meth:`Relay.run` relays the response but its last bytes and returns how it ended (a
:class:`RelayOutcome`); :meth:`Relay.end` sends them. A client therefore cannot send its next
turn before this one is recorded. The relay calls nothing of its caller's.

SSE responses are written event by event (never buffered whole); each decoded
event goes to the observer, whose verdict (:mod:`proxy.wire.base`) keeps, hides or
replaces it. The stream's terminal event (``data: [DONE]`` for chat) is held for :meth:`Relay.end`.

Plain bodies: one of known, bounded length is read whole and observed; :meth:`Relay.end` sends it
with its length. Any other (unknown length, compressed, or large) is relayed chunk by chunk as it
arrives, the observer fed on the side (it keeps a bounded buffer); the last chunk is held for
:meth:`Relay.end`. Memory stays bounded whatever the size of the response, a compressed one's
decoded size included: each read decodes at most :data:`~proxy.transport.http1.HIGH_WATER` bytes, the rest
as the relay reads on.

An upstream that fails mid-response ends the relay with ``RelayOutcome.upstream_error``
(the client's response breaks); one that fails before a byte was sent raises its
:class:`~proxy.errors.ProxyError`. Either is the upstream's failure, which the caller counts.
A server that cancels the handler (the client left) while the response streams cancels
:meth:`Relay.run`: the upstream request is closed, and :attr:`Relay.outcome` says
``client_gone``, for the caller to record what the client was delivered.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict

from ..core.sse import SSEDecoder
from ..errors import ProxyError, UpstreamUnreachable
from ..transport.client import UpstreamSender, forward_response_headers
from ..transport.pool import Response
from ..wire.base import Hide, Observer, Replace

log = logging.getLogger(__name__)

__all__ = ["EVENT_LIMIT", "WHOLE_BODY_LIMIT", "Relay", "RelayOutcome"]

WHOLE_BODY_LIMIT = 1024 * 1024
"""Plain bodies up to this many bytes (with a known length, uncompressed) are read whole."""
EVENT_LIMIT = 32 * 1024 * 1024
"""Bytes an event stream may send without completing an event (an event is written whole, so
they are held): past it, the stream ends as the upstream's failure instead of being held whole
(one endless event, such as a compressed stream of zeros that inflates a thousandfold)."""


@dataclass(slots=True, kw_only=True)
class RelayOutcome:
    """How a relay ended."""

    client_gone: bool = False
    """The client disconnected before the response was complete."""
    upstream_error: ProxyError | None = None
    """The upstream failed after the response had started."""
    complete: bool = False
    """Every byte of the upstream response was read."""


def is_event_stream(response: Response) -> bool:
    return response.content_type == "text/event-stream"


class Relay:
    """One upstream response on its way to the client through ``observer``, with ``headers`` added."""

    __slots__ = ("_held", "_out", "headers", "observer", "outcome", "request", "sender", "upstream")

    def __init__(
        self,
        request: web.Request,
        upstream: Response,
        sender: UpstreamSender,
        headers: dict[str, str],
        observer: Observer,
    ) -> None:
        self.request = request
        """The client's request: the response goes to its connection."""
        self.upstream = upstream
        self.sender = sender
        """Reads ``upstream``'s body."""
        self.headers = headers
        """Added to the upstream's response headers (kvwarm's report headers)."""
        self.observer = observer
        self.outcome = RelayOutcome()
        """How the relay ended, as far as it went: when :meth:`run` is cancelled, ``client_gone``
        says the client left mid-response (what it was delivered is the turn's to record)."""
        self._out: web.StreamResponse | None = None
        """The response to the client once started (None: a body read whole, sent by :meth:`end`)."""
        self._held: list[bytes] = []
        """What :meth:`end` sends: the terminal event, the last chunk, or the whole body."""

    async def run(self) -> RelayOutcome:
        """Relay the response but its last bytes; the outcome (also :attr:`outcome`)."""
        upstream = self.upstream
        if is_event_stream(upstream):
            await self._events()
        else:
            length = upstream.content_length
            if length is not None and length <= WHOLE_BODY_LIMIT and not upstream.headers.get(hdrs.CONTENT_ENCODING):
                await self._whole()
            else:
                await self._chunks()
        return self.outcome

    async def end(self) -> web.StreamResponse:
        """The last bytes: the client's response is complete (or, the upstream having failed, broken)."""
        if self._out is None:
            return web.Response(
                status=self.upstream.status, reason=self.upstream.reason, body=self._held[0], headers=self._response_headers()
            )
        return await _close(self.request, self._out, self.outcome, self._held)

    def _response_headers(self) -> CIMultiDict[str]:
        headers = forward_response_headers(self.upstream.headers, self.upstream.decoded)
        headers.update(self.headers)
        return headers

    async def _events(self) -> None:
        upstream, sender, observer, outcome = self.upstream, self.sender, self.observer, self.outcome
        out = self._out = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=self._response_headers())
        decoder = SSEDecoder()
        held = self._held
        unframed = 0  # bytes fed since a read last completed an event
        await out.prepare(self.request)
        try:
            while True:
                chunk = upstream.ready()  # what arrived already, without a coroutine per level
                if chunk is None:
                    try:
                        chunk = await sender.read_chunk(upstream)
                    except ProxyError as exc:
                        outcome.upstream_error = exc
                        break
                events = decoder.feed(chunk) if chunk else decoder.flush()
                unframed = 0 if events else unframed + len(chunk)
                if unframed > EVENT_LIMIT:
                    outcome.upstream_error = UpstreamUnreachable(f"the upstream's event stream sent {unframed} bytes without an event's end")
                    break
                if events:
                    keep = []
                    for event in events:
                        verdict = observer.on_event(event)
                        if isinstance(verdict, Hide):
                            continue
                        raw = verdict.raw if isinstance(verdict, Replace) else event.raw
                        if observer.is_terminal(event):
                            held.append(raw)
                        else:
                            keep.append(raw)
                    if keep:
                        await out.write(b"".join(keep) if len(keep) > 1 else keep[0])
                if not chunk:
                    outcome.complete = True
                    break
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            outcome.client_gone = True
        except asyncio.CancelledError:
            self._cancelled()
            raise
        finally:
            _done_with(upstream, outcome)

    async def _whole(self) -> None:
        upstream = self.upstream
        parts: list[bytes] = []
        try:
            while True:
                chunk = upstream.ready()  # what arrived already, without a coroutine per level
                if chunk is None:
                    chunk = await self.sender.read_chunk(upstream)
                if not chunk:
                    break
                parts.append(chunk)
        except BaseException:
            upstream.close()
            raise
        upstream.release()
        data = b"".join(parts)
        self.observer.on_body(data)
        self.outcome.complete = True
        self._held.append(data)

    async def _chunks(self) -> None:
        upstream, sender, observer, outcome = self.upstream, self.sender, self.observer, self.outcome
        try:
            held = await sender.read_chunk(upstream)
        except BaseException:
            upstream.close()
            raise
        out = self._out = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=self._response_headers())
        await out.prepare(self.request)
        try:
            while held:
                observer.on_body(held)
                try:
                    chunk = await sender.read_chunk(upstream)
                except ProxyError as exc:
                    outcome.upstream_error = exc
                    break
                if not chunk:
                    break
                await out.write(held)
                held = chunk
            outcome.complete = outcome.upstream_error is None
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            outcome.client_gone = True
        except asyncio.CancelledError:
            self._cancelled()
            raise
        finally:
            _done_with(upstream, outcome)
        if held and outcome.complete:
            self._held.append(held)

    def _cancelled(self) -> None:
        """The server cancelled the handler (the client disconnected): the upstream request is
        closed, and the outcome says the client is gone (the caller records what it was delivered)."""
        self.outcome.client_gone = True
        self.upstream.close()


def _done_with(upstream: Response, outcome: RelayOutcome) -> None:
    if outcome.complete:
        upstream.release()
    else:
        # Cancels the upstream request: the connection is closed, not returned to the pool.
        upstream.close()


async def _close(
    request: web.Request, out: web.StreamResponse, outcome: RelayOutcome, held: list[bytes]
) -> web.StreamResponse:
    if outcome.client_gone:
        return out
    if outcome.upstream_error is not None:
        # Mirror the upstream: the client sees the response break, not a clean end.
        out.force_close()
        if request.transport is not None:
            request.transport.close()
        return out
    try:
        for raw in held:
            await out.write(raw)
        await out.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        log.debug("client left before the end of the response")
    return out
