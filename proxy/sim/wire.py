"""The reference upstream's response plumbing, shared by its endpoints.

Error bodies, the one place errors are shaped: OpenAI's (:func:`error_response`,
chat and Responses) and Anthropic's (:func:`anthropic_error_response`, the Messages
API: ``{"type": "error", "error": {"type", "message"}, "request_id"}``); JSON
bodies (optionally gzipped), and :func:`write_events`: an SSE stream written event
by event under the request's faults (``stall``, ``reset_after``) and the configured
pause between chunks.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson
from aiohttp import hdrs, web

from .faults import Faults, drop_connection

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_ERROR_CODES = {
    401: "invalid_api_key",
    429: "rate_limit_exceeded",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
"""Anthropic's error ``type`` by status (its documented errors)."""
REQUEST_ID_HEADER = "request-id"
"""Where Anthropic names the request (``req_...``), on every response."""


def error_response(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    error_type: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""
    if error_type is None:
        error_type = _ERROR_TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
    payload = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return json_response(payload, status=status, headers=headers)


def anthropic_error_response(
    status: int,
    message: str,
    *,
    error_type: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """An Anthropic-style error: ``{"type": "error", "error": {"type", "message"}, "request_id"}``,
    with the ``request-id`` header."""
    if error_type is None:
        error_type = _ANTHROPIC_ERROR_TYPES.get(
            status, "api_error" if status >= 500 else "invalid_request_error"
        )
    request_id = new_request_id()
    payload = {
        "type": "error",
        "error": {"type": error_type, "message": message},
        "request_id": request_id,
    }
    all_headers = {**(headers or {}), REQUEST_ID_HEADER: request_id}
    return json_response(payload, status=status, headers=all_headers)


def new_request_id() -> str:
    """A fresh ``req_...`` id (Anthropic's ``request-id``)."""
    return "req_" + uuid.uuid4().hex


def fault_response(faults: Faults, *, anthropic: bool = False) -> web.Response:
    """The error a ``status=`` fault asked for, OpenAI-shaped or (``anthropic``) Anthropic-shaped."""
    assert faults.status is not None
    headers: dict[str, str] = {}
    if faults.retry_after is not None:
        headers[str(hdrs.RETRY_AFTER)] = faults.retry_after
    message = f"simulated upstream error {faults.status} (x-sim-fault)"
    if anthropic:
        return anthropic_error_response(faults.status, message, headers=headers)
    return error_response(
        faults.status,
        message,
        code=_ERROR_CODES.get(faults.status, "sim_fault"),
        headers=headers,
    )


def json_response(
    payload: Any,
    *,
    status: int = 200,
    headers: Mapping[str, str] | None = None,
    compress: bool = False,
) -> web.Response:
    """``payload`` as a JSON body; gzipped (``Content-Encoding: gzip``) when ``compress``."""
    data = orjson.dumps(payload)
    all_headers = dict(headers or {})
    if compress:
        data = gzip.compress(data)
        all_headers[hdrs.CONTENT_ENCODING] = "gzip"
    return web.Response(
        body=data, status=status, content_type="application/json", headers=all_headers
    )


async def write_events(
    request: web.Request,
    events: Sequence[bytes],
    faults: Faults,
    chunk_delay: float,
    before_last: Callable[[], None] | None = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[web.StreamResponse, bool]:
    """Stream ``events`` as ``text/event-stream`` (with ``headers`` besides); returns the
    response and whether it completed.

    ``before_last`` runs just before the last event is written: what the client
    may act on as soon as it reads that event (a stored response, the cached
    reply) must exist by then. It does not run when the stream is cut short.
    """
    response = web.StreamResponse(
        headers={
            **(headers or {}),
            hdrs.CONTENT_TYPE: "text/event-stream",
            hdrs.CACHE_CONTROL: "no-cache",
        }
    )
    await response.prepare(request)
    try:
        for position, event in enumerate(events):
            if faults.reset_after is not None and position >= faults.reset_after:
                drop_connection(request)
                return response, False
            if position > 0:
                pause = chunk_delay + faults.stall
                if pause:
                    await asyncio.sleep(pause)
            if position == len(events) - 1 and before_last is not None:
                before_last()
            await response.write(event)
        await response.write_eof()
    except ConnectionError:
        logger.debug("client went away mid-stream")
        return response, False
    return response, True
