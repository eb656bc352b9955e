"""Relaying an upstream response to the client as it arrives, through the response's observer.

SSE responses are written event by event (never buffered whole); each decoded
event goes to the observer, whose verdict (:mod:`proxy.wire.base`) keeps, hides or
replaces it. The stream's terminal event (``data: [DONE]`` for chat) is written
only after ``finish`` ran, so a client cannot send its next turn before this one is
recorded.

Plain bodies: one of known, bounded length is read whole, observed, and sent after
``finish`` with its length. Any other (unknown length, compressed, or large) is
relayed chunk by chunk as it arrives, the observer fed on the side (it keeps a
bounded buffer); the last chunk is held until ``finish`` ran. Memory stays bounded
whatever the size of the response, a compressed one's decoded size included: each read
decodes at most :data:`~proxy.http1.HIGH_WATER` bytes, the rest as the relay reads on.

An upstream that fails mid-response ends the relay with ``RelayOutcome.upstream_error``
(the client's response breaks); one that fails before a byte was sent raises its
:class:`~proxy.errors.ProxyError`. Either is the upstream's failure, which the caller counts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import hdrs, web

from .core.sse import SSEDecoder
from .errors import ProxyError, UpstreamUnreachable
from .transport import Response
from .upstream import UpstreamSender, forward_response_headers
from .wire.base import Hide, Observer, Replace

log = logging.getLogger(__name__)

__all__ = ["EVENT_LIMIT", "WHOLE_BODY_LIMIT", "RelayOutcome", "relay"]

WHOLE_BODY_LIMIT = 1024 * 1024
"""Plain bodies up to this many bytes (with a known length, uncompressed) are read whole."""
EVENT_LIMIT = 32 * 1024 * 1024
"""Bytes an event stream may send without completing an event (an event is written whole, so
they are held): past it, the stream ends as the upstream's failure instead of being held whole
(one endless event, such as a compressed stream of zeros that inflates a thousandfold)."""


@dataclass(slots=True)
class RelayOutcome:
    """How a relay ended."""

    client_gone: bool = False
    """The client disconnected before the response was complete."""
    upstream_error: ProxyError | None = None
    """The upstream failed after the response had started."""
    complete: bool = False
    """Every byte of the upstream response was read."""


Finish = Callable[[RelayOutcome], Awaitable[None]]
"""Called once the upstream response is over, before the client gets its last bytes."""


def is_event_stream(response: Response) -> bool:
    return response.content_type == "text/event-stream"


async def relay(
    request: web.Request,
    upstream: Response,
    sender: UpstreamSender,
    extra_headers: dict[str, str],
    observer: Observer,
    finish: Finish,
) -> web.StreamResponse:
    """Relay ``upstream`` to the client through ``observer``; ``finish`` runs before the last bytes."""
    if is_event_stream(upstream):
        return await _relay_events(request, upstream, sender, extra_headers, observer, finish)
    length = upstream.content_length
    if length is not None and length <= WHOLE_BODY_LIMIT and not upstream.headers.get(hdrs.CONTENT_ENCODING):
        return await _relay_whole(upstream, sender, extra_headers, observer, finish)
    return await _relay_chunks(request, upstream, sender, extra_headers, observer, finish)


async def _relay_events(
    request: web.Request,
    upstream: Response,
    sender: UpstreamSender,
    extra_headers: dict[str, str],
    observer: Observer,
    finish: Finish,
) -> web.StreamResponse:
    headers = forward_response_headers(upstream.headers, upstream.decoded)
    headers.update(extra_headers)
    out = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
    outcome = RelayOutcome()
    decoder = SSEDecoder()
    held: list[bytes] = []
    unframed = 0  # bytes fed since a read last completed an event
    await out.prepare(request)
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
        await _cancelled(upstream, outcome, finish)
        raise
    finally:
        _done_with(upstream, outcome)
    await finish(outcome)
    return await _close(request, out, outcome, held)


async def _relay_whole(
    upstream: Response,
    sender: UpstreamSender,
    extra_headers: dict[str, str],
    observer: Observer,
    finish: Finish,
) -> web.StreamResponse:
    parts: list[bytes] = []
    try:
        while True:
            chunk = upstream.ready()  # what arrived already, without a coroutine per level
            if chunk is None:
                chunk = await sender.read_chunk(upstream)
            if not chunk:
                break
            parts.append(chunk)
    except BaseException:
        upstream.close()
        raise
    upstream.release()
    data = b"".join(parts)
    observer.on_body(data)
    await finish(RelayOutcome(complete=True))
    headers = forward_response_headers(upstream.headers, upstream.decoded)
    headers.update(extra_headers)
    return web.Response(status=upstream.status, reason=upstream.reason, body=data, headers=headers)


async def _relay_chunks(
    request: web.Request,
    upstream: Response,
    sender: UpstreamSender,
    extra_headers: dict[str, str],
    observer: Observer,
    finish: Finish,
) -> web.StreamResponse:
    try:
        first = await sender.read_chunk(upstream)
    except BaseException:
        upstream.close()
        raise
    headers = forward_response_headers(upstream.headers, upstream.decoded)
    headers.update(extra_headers)
    out = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
    outcome = RelayOutcome()
    held = first
    await out.prepare(request)
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
        await _cancelled(upstream, outcome, finish)
        raise
    finally:
        _done_with(upstream, outcome)
    await finish(outcome)
    return await _close(request, out, outcome, [held] if held and outcome.complete else [])


async def _cancelled(upstream: Response, outcome: RelayOutcome, finish: Finish) -> None:
    """The server cancelled the handler (the client disconnected): close the upstream request and
    still record what the client was delivered, shielded from the cancellation."""
    outcome.client_gone = True
    upstream.close()
    await asyncio.shield(finish(outcome))


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
