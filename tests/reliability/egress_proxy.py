"""A small HTTP proxy for the egress tests, run as its own process (as a corporate proxy would be):

``python -m tests.reliability.egress_proxy [--auth USER:PASSWORD] [--resolve NAME=ADDRESS ...]``

It prints its port on the first line of stdout, then serves on 127.0.0.1 until killed:

- ``CONNECT host:port``: a tunnel, bytes copied both ways until either side closes;
- absolute-form ``http://host:port/path`` requests: forwarded in origin form (without the
  ``Proxy-*`` headers) on a new connection to the origin, the response relayed as it comes,
  then both connections closed;
- ``GET /stats`` (origin form, to the proxy itself): what it did, as JSON.

Names are resolved only from ``--resolve`` (made-up names such as ``upstream.kvwarm.test``,
which nothing else resolves: a client that went around the proxy fails); an IP address is
taken as is; any other name is answered 502. With ``--auth``, a request without that
``Proxy-Authorization: Basic`` is answered 407.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import ipaddress
import json
import sys
from contextlib import suppress
from typing import Any
from urllib.parse import urlsplit


class EgressProxy:
    def __init__(self, names: dict[str, str], auth: str) -> None:
        self.names = names
        self.authorization = "Basic " + base64.b64encode(auth.encode()).decode() if auth else ""
        self.stats: dict[str, Any] = {"tunnels": 0, "forwarded": 0, "refused": 0, "targets": [], "users": []}

    def resolve(self, host: str) -> str | None:
        host = host.strip("[]").lower()
        if host in self.names:
            return self.names[host]
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return None
        return host

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:] if line)]
            if method == "GET" and target == "/stats":
                await self.answer(writer, 200, "OK", json.dumps(self.stats).encode())
                return
            if not self.allowed(headers):
                self.stats["refused"] += 1
                await self.answer(writer, 407, "Proxy Authentication Required", b"", ("Proxy-Authenticate", 'Basic realm="test"'))
                return
            if method == "CONNECT":
                await self.tunnel(target, reader, writer)
            else:
                await self.forward(method, target, headers, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    def allowed(self, headers: list[tuple[str, str]]) -> bool:
        given = [v for k, v in headers if k.lower() == "proxy-authorization"]
        for value in given:
            scheme, _, token = value.partition(" ")
            if scheme == "Basic":
                self.stats["users"].append(base64.b64decode(token).decode().partition(":")[0])
        return not self.authorization or given == [self.authorization]

    async def tunnel(self, target: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, _, port = target.rpartition(":")
        address = self.resolve(host)
        if address is None:
            await self.answer(writer, 502, "Bad Gateway", b"unknown host")
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(address, int(port))
        except OSError:
            await self.answer(writer, 502, "Bad Gateway", b"unreachable")
            return
        self.stats["tunnels"] += 1
        self.stats["targets"].append(f"CONNECT {target}")
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))

    async def forward(
        self, method: str, target: str, headers: list[tuple[str, str]], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        url = urlsplit(target)
        address = self.resolve(url.hostname or "") if url.scheme == "http" else None
        if address is None:
            await self.answer(writer, 502, "Bad Gateway", b"not an absolute http URL of a known host")
            return
        length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
        body = await reader.readexactly(length)
        kept = [(k, v) for k, v in headers if not k.lower().startswith("proxy-") and k.lower() != "connection"]
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in kept), "Connection: close"]
        up_reader, up_writer = await asyncio.open_connection(address, url.port or 80)
        self.stats["forwarded"] += 1
        self.stats["targets"].append(f"{method} {target}")
        up_writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await copy(up_reader, writer)
        up_writer.close()

    @staticmethod
    async def answer(writer: asyncio.StreamWriter, status: int, reason: str, body: bytes, *extra: tuple[str, str]) -> None:
        lines = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in extra]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        await writer.drain()


async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Bytes from ``reader`` to ``writer`` until EOF; then ``writer`` is closed."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        with suppress(Exception):
            writer.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--auth", default="", help="USER:PASSWORD required in Proxy-Authorization")
    parser.add_argument("--resolve", action="append", default=[], help="NAME=ADDRESS")
    args = parser.parse_args()
    names = dict(item.lower().split("=", 1) for item in args.resolve)
    proxy = EgressProxy(names, args.auth)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    sys.stdout.close()
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    with suppress(KeyboardInterrupt):
        asyncio.run(main())
