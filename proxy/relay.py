"""Relaying an upstream response to the client as it arrives, with a tap for observers.

SSE responses are written event by event (never buffered whole); the tap sees
each decoded event and may hold one back from the client (the usage-only
chunk kvwarm asked for on the client's behalf). The terminal ``[DONE]`` event
is written only after ``finish`` ran, so a client cannot send its next turn
before this one is recorded. JSON bodies are read whole, observed, and sent
after ``finish``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from .core.sse import SSEDecoder, SSEEvent
from .errors import ProxyError
from .upstream import UpstreamSender, forward_response_headers

log = logging.getLogger(__name__)

DONE = "[DONE]"


@dataclass(slots=True)
class RelayOutcome:
    """How a relay ended."""

    client_gone: bool = False
    """The client disconnected before the response was complete."""
    upstream_error: ProxyError | None = None
    """The upstream failed after the response had started."""
    complete: bool = False
    """Every byte of the upstream response reached the client."""


def is_event_stream(response: aiohttp.ClientResponse) -> bool:
    return response.content_type == "text/event-stream"


async def relay_events(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    sender: UpstreamSender,
    extra_headers: dict[str, str],
    on_event: Callable[[SSEEvent], bool | bytes],
    finish: Callable[[RelayOutcome], Awaitable[None]],
) -> web.StreamResponse:
    """Relay an SSE stream; ``on_event`` returns False to keep an event from the client."""
    headers = forward_response_headers(upstream.headers)
    headers.update(extra_headers)
    out = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
    outcome = RelayOutcome()
    decoder = SSEDecoder()
    held: list[bytes] = []
    await out.prepare(request)
    try:
        while True:
            try:
                chunk = await sender.read_chunk(upstream)
            except ProxyError as exc:
                outcome.upstream_error = exc
                break
            events = decoder.feed(chunk) if chunk else decoder.flush()
            if events:
                keep = []
                for event in events:
                    verdict = on_event(event)
                    if verdict is False:
                        continue
                    raw = verdict if isinstance(verdict, bytes) else event.raw
                    if event.data == DONE:
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
    finally:
        if not outcome.complete:
            # Cancels the upstream request: the connection is closed, not returned to the pool.
            upstream.close()
        else:
            upstream.release()
    await finish(outcome)
    if outcome.client_gone:
        return out
    if outcome.upstream_error is not None:
        # Mirror the upstream: the client sees the stream break, not a clean end.
        out.force_close()
        if request.transport is not None:
            request.transport.close()
        return out
    try:
        for raw in held:
            await out.write(raw)
        await out.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        log.debug("client left before the end of the stream")
    return out


async def read_body(upstream: aiohttp.ClientResponse, sender: UpstreamSender) -> bytes:
    """The whole (decoded) upstream body."""
    parts: list[bytes] = []
    try:
        while chunk := await sender.read_chunk(upstream):
            parts.append(chunk)
    except BaseException:
        upstream.close()
        raise
    upstream.release()
    return b"".join(parts)
