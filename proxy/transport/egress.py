"""How kvwarm's connections leave the host: directly or through which HTTP proxy, the tunnel
through it, and the TLS context upstream certificates are verified with.

- :class:`Proxy` -- an egress proxy, ``http://[user:password@]host:port``. Its credentials
  travel only in ``Proxy-Authorization`` (Basic); its :attr:`~Proxy.label`, the only way it
  is named in errors and logs, never holds them.
- :class:`NoProxy` -- the hosts reached directly, read as curl and requests read
  ``NO_PROXY``: a comma list of ``*``, domain suffixes (``example.com`` and ``.example.com``
  both match ``example.com`` and its subdomains), IP addresses, CIDR ranges, each with an
  optional ``:port``.
- :class:`Egress` -- the choice for every upstream URL (:meth:`Egress.route`), built once from
  the settings. The environment (``HTTPS_PROXY``, ``HTTP_PROXY``, ``NO_PROXY`` and their
  lowercase forms) was read by :mod:`proxy.config` at start-up: nothing here reads
  ``os.environ``. The TLS context's default trust is OpenSSL's, which honours
  ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` when a context is built (as Python's own default
  context does).
- :class:`Route` -- how connections to one origin are opened and kept: the transport's pool
  keys its connections by origin and route (direct, or through which proxy).
- :func:`open_tunnel` -- ``CONNECT host:port`` through a proxy, for an https upstream (TLS to
  the upstream then runs inside the tunnel: ``loop.start_tls``). A plain-http upstream is
  reached through a proxy with absolute-form request targets instead (RFC 9112 3.2.2).
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import re
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final
from urllib.parse import unquote, urlsplit

from yarl import URL

from .http1 import ConnectFailed, ProxyRefused

if TYPE_CHECKING:
    from ..config import UpstreamSettings

__all__ = [
    "DIRECT", "IDLE_CONNECTION_TIMEOUT", "Egress", "NoProxy", "Proxy", "ProxyRefused", "Route", "check_tls_files",
    "open_tunnel", "tls_context",
]

IDLE_CONNECTION_TIMEOUT: Final = 4.0
"""Seconds an idle pooled connection is kept (``upstream.idle_connection_timeout``): below the
5 s after which uvicorn (vLLM, SGLang), llama.cpp's server and Node close an idle keep-alive
connection, so a connection kvwarm reuses is one its server has not begun to close."""

MAX_PROXY_HEAD: Final = 64 * 1024
"""Bytes a proxy's answer to CONNECT may take before its blank line."""


# -- proxies ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Proxy:
    """An HTTP proxy. Compared (and pooled) with its credentials; named without them."""

    host: str
    port: int
    authorization: str = field(default="", repr=False)
    """The ``Proxy-Authorization`` value (``Basic ...``), or "" without credentials."""

    @property
    def label(self) -> str:
        """``http://host:port``: how errors and logs name the proxy (never its credentials)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    def parse(cls, url: str) -> Proxy:
        """``[http://][user[:password]@]host[:port]`` (the port defaults to 80, as URLs say).
        Raises ValueError with a message that never quotes the credentials."""
        text = url.strip()
        if "://" not in text:
            text = "http://" + text  # as curl and requests read a bare host:port
        where = _redacted(text)
        try:
            parts = urlsplit(text)
        except ValueError:
            raise ValueError(f"{where}: not a URL") from None
        scheme = parts.scheme.lower()
        if scheme != "http":
            raise ValueError(
                f"{where}: only http:// proxies are supported (TLS to the upstream runs inside the "
                f"proxy's CONNECT tunnel), not {scheme}://"
            )
        try:
            host, port = parts.hostname, parts.port
        except ValueError:
            raise ValueError(f"{where}: the port is not a number from 1 to 65535") from None
        if not host:
            raise ValueError(f"{where}: names no host")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"{where}: a proxy URL is http://[user:password@]host:port, without a path")
        authorization = ""
        if parts.username is not None:
            credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            authorization = "Basic " + base64.b64encode(credentials.encode("utf-8")).decode("ascii")
        return cls(host=host, port=port if port is not None else 80, authorization=authorization)


def _redacted(url: str) -> str:
    """``url`` with everything up to its last ``@`` replaced by ``***`` (a password may hold
    an unencoded ``/``: better to hide a path than to show a piece of it)."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    return f"{scheme}{sep}{rest}"


@dataclass(frozen=True, slots=True, kw_only=True)
class NoProxy:
    """The hosts reached without a proxy (``NO_PROXY`` syntax). An entry that is neither
    ``*``, an address, a range nor a name matches nothing (as curl and requests ignore it)."""

    everything: bool = False
    names: tuple[tuple[str, int | None], ...] = ()
    """Domain suffixes (lowercase, no leading or trailing dot), each with its port or None."""
    networks: tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, int | None], ...] = ()

    @classmethod
    def parse(cls, text: str) -> NoProxy:
        everything = False
        names: list[tuple[str, int | None]] = []
        networks: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, int | None]] = []
        for entry in re.split(r"[,\s]+", text.strip()):
            if not entry:
                continue
            if entry == "*":
                everything = True
                continue
            host, port = _split_port(entry)
            network = _network(host)
            if network is not None:
                networks.append((network, port))
                continue
            name = host.lower().lstrip("*").strip(".")
            if name:
                names.append((name, port))
        return cls(everything=everything, names=tuple(names), networks=tuple(networks))

    def bypasses(self, host: str, port: int) -> bool:
        """``host:port`` is reached directly."""
        if self.everything:
            return True
        name = host.lower().strip("[]").rstrip(".")
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return any(
                (name == suffix or name.endswith("." + suffix)) and (only is None or only == port)
                for suffix, only in self.names
            )
        return any(address in network and (only is None or only == port) for network, only in self.networks)


def _split_port(entry: str) -> tuple[str, int | None]:
    """``host:port``, ``[v6]:port``, ``[v6]``, a bare IPv6 address or a host -> (host, port)."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        if port.isdigit():
            return host, int(port)
    return entry, None


def _network(host: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(host, strict=False)
    except ValueError:
        return None


# -- routes ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """How connections to an origin are opened and kept. The transport pools connections by
    origin and route: a connection opened through one proxy is never used for another, nor
    for a direct request."""

    proxy: Proxy | None = None
    """Through this proxy (CONNECT for https, absolute-form targets for http); None: directly."""
    tls: ssl.SSLContext | None = None
    """The TLS context for https origins; None: the transport's (by default, the system's trust)."""
    idle_timeout: float = IDLE_CONNECTION_TIMEOUT
    """Seconds a connection stays idle in the pool before it is closed (never reused after)."""


DIRECT: Final = Route()


@dataclass(frozen=True, slots=True, kw_only=True)
class Egress:
    """Which route each upstream URL takes, decided once from the settings."""

    http: Proxy | None = None
    """The proxy for ``http://`` upstreams."""
    https: Proxy | None = None
    """The proxy for ``https://`` upstreams."""
    no_proxy: NoProxy = NoProxy()
    tls: ssl.SSLContext | None = None
    idle_timeout: float = IDLE_CONNECTION_TIMEOUT

    @classmethod
    def of(cls, settings: UpstreamSettings) -> Egress:
        """``upstream.proxy`` when set ("" = none) for both schemes, else the proxies the
        environment named (``upstream.http_proxy`` / ``https_proxy``); ``upstream.no_proxy``;
        the TLS context when ``ca_file`` or a client certificate is set (else the default one)."""
        if settings.proxy is not None:
            http = https = settings.proxy
        else:
            http, https = settings.http_proxy, settings.https_proxy
        tls = None
        if settings.ca_file or settings.client_cert:
            tls = tls_context(settings.ca_file, settings.client_cert, settings.client_key)
        return cls(
            http=Proxy.parse(http) if http else None,
            https=Proxy.parse(https) if https else None,
            no_proxy=NoProxy.parse(settings.no_proxy),
            tls=tls,
            idle_timeout=settings.idle_connection_timeout,
        )

    def route(self, url: URL) -> Route:
        """The route to ``url``'s origin."""
        tls = url.scheme == "https"
        proxy = self.https if tls else self.http
        host = url.raw_host or ""
        port = url.port if url.port is not None else (443 if tls else 80)
        if proxy is not None and self.no_proxy.bypasses(host, port):
            proxy = None
        return Route(proxy=proxy, tls=self.tls, idle_timeout=self.idle_timeout)


# -- TLS -----------------------------------------------------------------------------------------


def tls_context(ca_file: str = "", client_cert: str = "", client_key: str = "") -> ssl.SSLContext:
    """The default context (the system's trust, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``; host
    names checked) plus the CAs of ``ca_file``, and ``client_cert`` (with ``client_key``, or
    a key inside the certificate's file) presented when the upstream asks for one."""
    context = ssl.create_default_context()
    load_tls_files(context, ca_file, client_cert, client_key)
    return context


def load_tls_files(context: ssl.SSLContext, ca_file: str, client_cert: str, client_key: str) -> None:
    """Load the files into ``context``. Raises ValueError naming the setting and the file."""
    if ca_file:
        try:
            context.load_verify_locations(cafile=ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"ca_file: cannot load CA certificates from {ca_file}: {exc}") from None
    if client_cert:
        try:
            context.load_cert_chain(client_cert, client_key or None)
        except (OSError, ssl.SSLError) as exc:
            files = f"{client_cert} and {client_key}" if client_key else client_cert
            raise ValueError(f"client_cert: cannot load a certificate and its key from {files}: {exc}") from None


def check_tls_files(ca_file: str, client_cert: str, client_key: str) -> None:
    """What :func:`tls_context` would refuse, without loading the system's trust."""
    if client_key and not client_cert:
        raise ValueError("client_key: is set without client_cert")
    load_tls_files(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), ca_file, client_cert, client_key)


# -- CONNECT ---------------------------------------------------------------------------------------


class _ConnectReply(asyncio.Protocol):
    """Reads the proxy's answer to CONNECT: its head, up to the blank line."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.head: asyncio.Future[bytes] = loop.create_future()
        self.rest = b""
        """Bytes after the head (a refusal's body; after a 2xx, none may come before TLS)."""
        self._buffer = b""

    def data_received(self, data: bytes) -> None:
        if self.head.done():
            self.rest += data
            return
        self._buffer += data
        end = self._buffer.find(b"\r\n\r\n")
        if end >= 0:
            self.head.set_result(self._buffer[:end])
            self.rest = self._buffer[end + 4 :]
        elif len(self._buffer) > MAX_PROXY_HEAD:
            self.head.set_exception(ConnectionError(f"the proxy's answer to CONNECT is longer than {MAX_PROXY_HEAD} bytes"))

    def eof_received(self) -> bool | None:
        self._closed(None)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed(exc)

    def _closed(self, exc: Exception | None) -> None:
        if not self.head.done():
            detail = f": {exc}" if exc is not None else ""
            self.head.set_exception(ConnectionError(f"the proxy closed the connection before answering CONNECT{detail}"))


def connect_request(proxy: Proxy, host: str, port: int) -> bytes:
    """``CONNECT host:port``, with the proxy's credentials when it has some."""
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    if proxy.authorization:
        lines.append(f"Proxy-Authorization: {proxy.authorization}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")  # (a URL's host is IDNA-encoded)


async def open_tunnel(loop: asyncio.AbstractEventLoop, proxy: Proxy, host: str, port: int) -> asyncio.Transport:
    """A connection to ``proxy`` tunnelled to ``host:port`` (the proxy resolves the name).
    Raises :class:`ProxyRefused` (not 2xx), OSError (the proxy unreachable, or it closed),
    :class:`ConnectFailed` (its answer is not HTTP)."""
    reply = _ConnectReply(loop)
    transport, _ = await loop.create_connection(lambda: reply, proxy.host, proxy.port)
    try:
        transport.write(connect_request(proxy, host, port))
        status, reason = _status(await reply.head, proxy)
        if not 200 <= status < 300:
            raise ProxyRefused(f"the proxy {proxy.label} answered CONNECT {host}:{port} with {status} {reason}".rstrip(), status=status)
        if reply.rest:
            raise ConnectFailed(f"the proxy {proxy.label} sent bytes into the tunnel before TLS began")
        return transport
    except BaseException:
        transport.abort()
        raise


def _status(head: bytes, proxy: Proxy) -> tuple[int, str]:
    """The status and (printable, bounded) reason of a response head."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    version, _, rest = line.partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise ConnectFailed(f"the proxy {proxy.label} answered CONNECT with something that is not HTTP/1.1")
    return int(code), "".join(c for c in reason[:80] if c.isprintable())
