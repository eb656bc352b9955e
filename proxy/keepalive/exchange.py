"""One ping on the wire: its bytes made once, sent once to the session's replica, its answer read.

:func:`ping_of` makes the ping of a watched request (:mod:`proxy.keepalive.ping`) the first time
one is due, a large request in a worker thread, off the event loop, and drops the request's bytes;
:func:`exchange` sends it through the replica's sender (no routing, no failover: the prefix is
cached on that replica) and reads the answer whole, within :data:`PING_TIMEOUT` and
:data:`MAX_ANSWER`; :func:`usage_of` reads what the ping read and wrote. What a ping decides and
counts is the keeper's (:mod:`proxy.keepalive.keeper`).
"""

from __future__ import annotations

import asyncio

import orjson

from ..core.usage import Usage, extract_usage
from .ping import output_limit, ping_body
from .watch import Watch

__all__ = ["MAX_ANSWER", "PING_TIMEOUT", "THREAD_BYTES", "exchange", "ping_of", "usage_of"]

PING_TIMEOUT = 120.0
"""Seconds a ping may take in all (loop time); then it has failed."""
MAX_ANSWER = 1 << 20
"""Bytes of a ping's answer read at most (one output token: a few hundred)."""
THREAD_BYTES = 256 * 1024
"""A request larger than this is cut into its ping in a worker thread, off the event loop."""


async def ping_of(watch: Watch) -> bytes | None:
    """The session's ping bytes, made once (a large request in a worker thread); None: the
    request cannot be cut into one."""
    if watch.body is None and watch.raw:
        raw, watch.raw = watch.raw, b""
        if len(raw) > THREAD_BYTES:
            watch.body = await asyncio.to_thread(ping_body, watch.api, raw, watch.dialect)
            watch.output = max(watch.output, await asyncio.to_thread(output_limit, watch.api, raw))
        else:
            watch.body = ping_body(watch.api, raw, watch.dialect)
            watch.output = max(watch.output, output_limit(watch.api, raw))
    return watch.body


async def exchange(watch: Watch, body: bytes) -> tuple[int, bytes]:
    """The ping's status and answer, read whole (within :data:`PING_TIMEOUT` and :data:`MAX_ANSWER`)."""
    assert watch.replica is not None and watch.headers is not None
    sender = watch.replica.sender
    async with asyncio.timeout(PING_TIMEOUT):
        response = await sender.send("POST", watch.path, watch.query, dict(watch.headers), body)
        chunks: list[bytes] = []
        try:
            size = 0
            while chunk := await sender.read_chunk(response):
                size += len(chunk)
                if size > MAX_ANSWER:
                    raise ValueError(f"the answer is larger than {MAX_ANSWER} bytes")
                chunks.append(chunk)
        except BaseException:
            response.close()
            raise
        response.release()
    return response.status, b"".join(chunks)


def usage_of(answer: bytes) -> Usage | None:
    """The usage of a ping's answer; None: not a JSON object, or none reported."""
    try:
        body = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    return extract_usage(body) if type(body) is dict else None
