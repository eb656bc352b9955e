"""The bare pass-through: the least a reverse proxy must do, as a baseline for kvwarm's overhead.

One pooled :class:`aiohttp.ClientSession`; every request's method, path, query, body and
headers (minus hop-by-hop ones) are forwarded to the upstream, and the response is streamed
back chunk by chunk as it arrives. No parsing, no metrics, no logging. It runs on uvloop
when installed, like ``kvwarm serve`` (``server.uvloop = true``).

With ``--client kvwarm`` the same pass-through sends on kvwarm's own transport
(:mod:`proxy.transport.pool`) instead: what kvwarm's plumbing costs without its own work.

``python -m tests.bench.passthrough --port P --upstream http://127.0.0.1:U/v1 [--client kvwarm]``
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Mapping
from importlib import metadata

import aiohttp
from aiohttp import hdrs, web
from yarl import URL

from proxy.transport.pool import Origin, Pool, Transport

_HOP = frozenset(
    h.lower()
    for h in (
        hdrs.CONNECTION, "Keep-Alive", hdrs.PROXY_AUTHENTICATE, hdrs.PROXY_AUTHORIZATION,
        hdrs.TE, hdrs.TRAILER, hdrs.TRANSFER_ENCODING, hdrs.UPGRADE, hdrs.HOST, hdrs.CONTENT_LENGTH,
    )
)
SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)
TRANSPORT = web.AppKey("transport", Transport)
POOL = web.AppKey("pool", Pool)
BASE_PATH = web.AppKey("base_path", str)


async def _session(app: web.Application) -> AsyncIterator[None]:
    connector = aiohttp.TCPConnector(limit=256)
    app[SESSION] = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    yield
    await app[SESSION].close()


async def forward(request: web.Request) -> web.StreamResponse:
    tail = request.match_info["tail"]
    url = f"{request.app[UPSTREAM]}/{tail}"
    if request.query_string:
        url += "?" + request.query_string
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
    body = await request.read()
    async with request.app[SESSION].request(
        request.method, url, headers=headers, data=body or None, allow_redirects=False
    ) as upstream:
        out = await _respond(request, upstream.status, upstream.reason, upstream.headers, upstream.content_length)
        async for chunk in upstream.content.iter_any():
            await out.write(chunk)
        await out.write_eof()
        return out


async def _respond(
    request: web.Request, status: int, reason: str | None, headers: Mapping[str, str], length: int | None
) -> web.StreamResponse:
    """The client's response, started with the upstream's status and end-to-end headers."""
    out = web.StreamResponse(status=status, reason=reason)
    for k, v in headers.items():
        if k.lower() not in _HOP:
            out.headers.add(k, v)
    if length is not None:
        out.content_length = length
    await out.prepare(request)
    return out


async def _transport(app: web.Application) -> AsyncIterator[None]:
    transport = app[TRANSPORT] = Transport(limit=256, connect_timeout=10.0)
    url = URL(app[UPSTREAM])
    app[POOL] = transport.pool(Origin.of(url))
    app[BASE_PATH] = url.raw_path.rstrip("/")
    yield
    await transport.close()


async def forward_on_transport(request: web.Request) -> web.StreamResponse:
    """:func:`forward`, sent on kvwarm's transport."""
    target = request.app[BASE_PATH] + "/" + request.match_info["tail"]
    if request.query_string:
        target += "?" + request.query_string
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
    body = await request.read()
    upstream = await request.app[TRANSPORT].request(request.app[POOL], request.method, target, headers, body, within=600.0)
    try:
        out = await _respond(request, upstream.status, upstream.reason, upstream.headers, upstream.content_length)
        while chunk := await upstream.read_chunk(300.0):
            await out.write(chunk)
        await out.write_eof()
    finally:
        upstream.release()
    return out


def create_passthrough(upstream: str, client: str = "aiohttp") -> web.Application:
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[UPSTREAM] = upstream.rstrip("/")
    if client == "kvwarm":
        app.cleanup_ctx.append(_transport)
        app.router.add_route("*", "/v1/{tail:.*}", forward_on_transport)
    else:
        app.cleanup_ctx.append(_session)
        app.router.add_route("*", "/v1/{tail:.*}", forward)
    return app


def loop_kind() -> str:
    try:
        version = metadata.version("uvloop")
    except metadata.PackageNotFoundError:
        return "asyncio"
    return f"uvloop {version}"


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:8090/v1")
    parser.add_argument("--client", choices=("aiohttp", "kvwarm"), default="aiohttp", help="what sends upstream")
    args = parser.parse_args()
    web.run_app(
        create_passthrough(args.upstream, args.client), host=args.host, port=args.port,
        access_log=None, print=None, loop=_new_loop(),
    )


if __name__ == "__main__":
    main()
