"""kvwarm behind an egress proxy, as users configure one everywhere, all on loopback.

The proxy is a real process (``tests/reliability/egress_proxy.py``): CONNECT tunnels and
absolute-form forwarding, counting what it did. It alone resolves ``upstream.kvwarm.test``
(to 127.0.0.1): a request that went around it cannot reach that name. The upstream is the
reference upstream, over TLS with a certificate of its own CA (``trustme``) where it says
https. kvwarm is a whole app, its settings loaded as ``kvwarm serve`` loads them (an
environment of ``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``NO_PROXY``, then the keys), driven with
the openai SDK.

Also here: the NO_PROXY matching rules, the proxy URL's parsing, and the settings' reading of
the environment (pure, no sockets).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import select
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import trustme
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry
from yarl import URL

from proxy.app import create_app
from proxy.config import load_settings
from proxy.errors import ConfigError
from proxy.sim.server import SimConfig, create_sim_app
from proxy.transport.egress import Egress, NoProxy, Proxy, Route
from proxy.transport.pool import Origin, ProxyRefused, Transport, read_chunk
from tests.conftest import received

ROOT = Path(__file__).resolve().parents[2]
NAME = "upstream.kvwarm.test"
"""A name only the test proxy resolves."""
PASSWORD = "s3cret p@ss/word"
"""The authenticating proxy's password (percent-encoded in the proxy URL)."""
QUOTED_PASSWORD = "s3cret%20p%40ss%2Fword"
WAIT = 10.0
MESSAGES = [{"role": "user", "content": "Say hello through the proxy."}]


# -- the proxy process -------------------------------------------------------------------------


@dataclass
class ProxyProcess:
    process: subprocess.Popen[bytes]
    port: int

    def url(self, userinfo: str = "") -> str:
        return f"http://{userinfo + '@' if userinfo else ''}127.0.0.1:{self.port}"

    async def stats(self) -> dict[str, Any]:
        """What the proxy did so far (``GET /stats`` to the proxy itself)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(b"GET /stats HTTP/1.1\r\nHost: proxy\r\n\r\n")
            async with asyncio.timeout(WAIT):
                data = await reader.read()
        finally:
            writer.close()
        stats: dict[str, Any] = json.loads(data.partition(b"\r\n\r\n")[2])
        return stats


def start_proxy(*args: str) -> Iterator[ProxyProcess]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.egress_proxy", "--resolve", f"{NAME}=127.0.0.1", *args],
        stdout=subprocess.PIPE, cwd=ROOT,
    )
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 30.0)
        line = process.stdout.readline() if ready else b""
        assert line.strip().isdigit(), f"the test proxy did not start: {line!r}"
        yield ProxyProcess(process, int(line))
    finally:
        process.kill()
        process.wait(timeout=WAIT)
        if process.stdout is not None:
            process.stdout.close()


@pytest.fixture(scope="module")
def egress_proxy() -> Iterator[ProxyProcess]:
    yield from start_proxy()


@pytest.fixture(scope="module")
def auth_proxy() -> Iterator[ProxyProcess]:
    """A proxy that wants ``Proxy-Authorization: Basic`` of ``kvwarm`` / :data:`PASSWORD`."""
    yield from start_proxy("--auth", f"kvwarm:{PASSWORD}")


# -- upstreams and kvwarm ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> str:
    path = tmp_path / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


async def tls_sim(aiohttp_server: Any, ca: trustme.CA, *, client_cert_required: bool = False) -> TestServer:
    """The reference upstream on https, its certificate for :data:`NAME` and ``localhost``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(NAME, "localhost").configure_cert(context)
    if client_cert_required:
        context.verify_mode = ssl.CERT_REQUIRED
        ca.configure_trust(context)
    server: TestServer = await aiohttp_server(create_sim_app(SimConfig()), ssl=context, host="127.0.0.1")
    return server


async def kvwarm(aiohttp_server: Any, base_url: str, env: dict[str, str] | None = None, **keys: Any) -> TestServer:
    """kvwarm in front of ``base_url``, its settings read from ``env`` and then ``keys``
    (``upstream__proxy`` for ``upstream.proxy``)."""
    overrides = {"store.backend": "memory", "upstream.base_url": base_url, **{k.replace("__", "."): v for k, v in keys.items()}}
    app = create_app(load_settings(None, env=env or {}, overrides=overrides), registry=CollectorRegistry())
    server: TestServer = await aiohttp_server(app)
    return server


async def chat(server: TestServer) -> Any:
    async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="sk-test", max_retries=0) as client:
        return await client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)  # type: ignore[arg-type]


async def refused(server: TestServer) -> openai.APIStatusError:
    """The error a chat request gets (it must fail with an HTTP status)."""
    with pytest.raises(openai.APIStatusError) as caught:
        await chat(server)
    return caught.value


# -- https through the proxy -------------------------------------------------------------------


async def test_an_https_upstream_is_reached_through_a_connect_tunnel_from_https_proxy(
    aiohttp_server: Any, egress_proxy: ProxyProcess, ca: trustme.CA, ca_file: str
) -> None:
    """HTTPS_PROXY from the environment; TLS to the upstream inside the tunnel, verified for
    its name against ``upstream.ca_file``; the tunnel is reused like any keep-alive connection."""
    upstream = await tls_sim(aiohttp_server, ca)
    before = await egress_proxy.stats()
    server = await kvwarm(
        aiohttp_server, f"https://{NAME}:{upstream.port}/v1", {"HTTPS_PROXY": egress_proxy.url()}, upstream__ca_file=ca_file
    )
    for _ in range(2):
        reply = await chat(server)
        assert reply.choices[0].message.content
    after = await egress_proxy.stats()
    assert after["tunnels"] - before["tunnels"] == 1  # one tunnel, two requests through it
    assert after["targets"][len(before["targets"]) :] == [f"CONNECT {NAME}:{upstream.port}"]
    assert len(received(upstream)) == 2


async def test_without_the_ca_file_the_upstream_certificate_is_refused_through_the_tunnel(
    aiohttp_server: Any, egress_proxy: ProxyProcess, ca: trustme.CA
) -> None:
    upstream = await tls_sim(aiohttp_server, ca)
    server = await kvwarm(aiohttp_server, f"https://{NAME}:{upstream.port}/v1", {"https_proxy": egress_proxy.url()})
    error = await refused(server)
    assert error.status_code == 502
    assert "certificate verify failed" in error.message
    assert received(upstream) == []


async def test_a_client_certificate_is_presented_when_the_upstream_requires_one(
    aiohttp_server: Any, egress_proxy: ProxyProcess, ca: trustme.CA, ca_file: str, tmp_path: Path
) -> None:
    upstream = await tls_sim(aiohttp_server, ca, client_cert_required=True)
    cert = ca.issue_cert("kvwarm-client")
    cert_file, key_file = tmp_path / "client.pem", tmp_path / "client.key"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    base = f"https://{NAME}:{upstream.port}/v1"
    env = {"HTTPS_PROXY": egress_proxy.url()}

    without = await kvwarm(aiohttp_server, base, env, upstream__ca_file=ca_file)
    assert (await refused(without)).status_code == 502
    assert received(upstream) == []

    with_cert = await kvwarm(
        aiohttp_server, base, env, upstream__ca_file=ca_file, upstream__client_cert=str(cert_file), upstream__client_key=str(key_file)
    )
    assert (await chat(with_cert)).choices[0].message.content
    assert len(received(upstream)) == 1


async def test_ssl_cert_file_in_the_environment_is_trusted(
    aiohttp_server: Any, ca: trustme.CA, ca_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenSSL's default trust (Python's default context) honours SSL_CERT_FILE: no
    ``upstream.ca_file`` needed. (Direct to https://localhost: no proxy involved.)"""
    upstream = await tls_sim(aiohttp_server, ca)
    base = f"https://localhost:{upstream.port}/v1"
    assert (await refused(await kvwarm(aiohttp_server, base))).status_code == 502  # the CA is unknown
    monkeypatch.setenv("SSL_CERT_FILE", ca_file)
    assert (await chat(await kvwarm(aiohttp_server, base))).choices[0].message.content


@pytest.fixture
def ca_dir(ca_file: str, tmp_path: Path) -> str:
    """A directory holding the CA as OpenSSL looks certificates up (``openssl rehash``)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl binary to hash a certificate directory (openssl rehash)")
    folder = tmp_path / "certs"
    folder.mkdir()
    shutil.copy(ca_file, folder / "upstream-ca.pem")
    subprocess.run([openssl, "rehash", str(folder)], check=True, capture_output=True, timeout=30)
    return str(folder)


async def test_ssl_cert_dir_in_the_environment_is_trusted(
    aiohttp_server: Any, ca: trustme.CA, ca_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream = await tls_sim(aiohttp_server, ca)
    monkeypatch.setenv("SSL_CERT_DIR", ca_dir)
    assert (await chat(await kvwarm(aiohttp_server, f"https://localhost:{upstream.port}/v1"))).choices[0].message.content


# -- plain http, NO_PROXY, the setting over the environment --------------------------------------


async def test_a_plain_http_upstream_is_reached_with_absolute_form_targets(
    aiohttp_server: Any, egress_proxy: ProxyProcess, sim: TestServer
) -> None:
    before = await egress_proxy.stats()
    server = await kvwarm(aiohttp_server, f"http://{NAME}:{sim.port}/v1", {"http_proxy": egress_proxy.url()})
    assert (await chat(server)).choices[0].message.content
    after = await egress_proxy.stats()
    assert after["forwarded"] - before["forwarded"] == 1
    assert after["targets"][len(before["targets"]) :] == [f"POST http://{NAME}:{sim.port}/v1/chat/completions"]
    assert len(received(sim)) == 1


@pytest.mark.parametrize("no_proxy", ["localhost,127.0.0.1", "127.0.0.0/8", "*", ".example.com, 127.0.0.1:{port}"])
async def test_no_proxy_sends_matching_upstreams_directly(
    aiohttp_server: Any, egress_proxy: ProxyProcess, sim: TestServer, no_proxy: str
) -> None:
    before = await egress_proxy.stats()
    env = {"HTTP_PROXY": egress_proxy.url(), "NO_PROXY": no_proxy.format(port=sim.port)}
    server = await kvwarm(aiohttp_server, f"http://127.0.0.1:{sim.port}/v1", env)
    assert (await chat(server)).choices[0].message.content
    assert (await egress_proxy.stats())["forwarded"] == before["forwarded"]
    assert len(received(sim)) == 1


async def test_an_upstream_no_proxy_does_not_list_goes_through_the_proxy(
    aiohttp_server: Any, egress_proxy: ProxyProcess, sim: TestServer
) -> None:
    """The control of the test above: the same upstream, a NO_PROXY for another port."""
    before = await egress_proxy.stats()
    env = {"HTTP_PROXY": egress_proxy.url(), "NO_PROXY": f"localhost,127.0.0.1:{sim.port + 1}"}
    server = await kvwarm(aiohttp_server, f"http://127.0.0.1:{sim.port}/v1", env)
    assert (await chat(server)).choices[0].message.content
    assert (await egress_proxy.stats())["forwarded"] == before["forwarded"] + 1


async def test_upstream_proxy_overrides_the_environment_and_empty_means_direct(
    aiohttp_server: Any, egress_proxy: ProxyProcess, sim: TestServer, unused_tcp_port: int
) -> None:
    dead = f"http://127.0.0.1:{unused_tcp_port}"
    before = await egress_proxy.stats()
    via = await kvwarm(aiohttp_server, f"http://{NAME}:{sim.port}/v1", {"HTTP_PROXY": dead}, upstream__proxy=egress_proxy.url())
    assert (await chat(via)).choices[0].message.content
    assert (await egress_proxy.stats())["forwarded"] == before["forwarded"] + 1

    direct = await kvwarm(aiohttp_server, f"http://127.0.0.1:{sim.port}/v1", {"HTTP_PROXY": dead}, upstream__proxy="")
    assert (await chat(direct)).choices[0].message.content
    assert (await egress_proxy.stats())["forwarded"] == before["forwarded"] + 1
    assert len(received(sim)) == 2


async def test_connections_are_pooled_by_route_not_only_by_origin(
    aiohttp_server: Any, egress_proxy: ProxyProcess, sim: TestServer
) -> None:
    """An idle direct connection to an origin never carries a request meant to go through a
    proxy to that origin (nor the reverse)."""
    transport = Transport(limit=8, connect_timeout=WAIT)
    try:
        origin = Origin(host="127.0.0.1", port=sim.port, tls=False)
        direct = transport.pool(origin)
        proxied = transport.pool(origin, Route(proxy=Proxy(host="127.0.0.1", port=egress_proxy.port)))
        assert direct is not proxied and transport.pool(origin, Route(proxy=Proxy(host="127.0.0.1", port=egress_proxy.port))) is proxied
        before = await egress_proxy.stats()
        for pool in (direct, proxied, direct):
            response = await transport.request(pool, "GET", "/v1/models", [], b"", within=WAIT)
            assert response.status == 200
            while await read_chunk(response, WAIT):
                pass
            response.release()
        assert (await egress_proxy.stats())["forwarded"] == before["forwarded"] + 1
        assert len(direct.open) == 1
    finally:
        await transport.close()


# -- proxy credentials and refusals --------------------------------------------------------------


async def test_proxy_credentials_travel_as_basic_proxy_authorization(
    aiohttp_server: Any, auth_proxy: ProxyProcess, ca: trustme.CA, ca_file: str, sim: TestServer
) -> None:
    https = await tls_sim(aiohttp_server, ca)
    proxy = auth_proxy.url(f"kvwarm:{QUOTED_PASSWORD}")
    for base in (f"https://{NAME}:{https.port}/v1", f"http://{NAME}:{sim.port}/v1"):
        server = await kvwarm(aiohttp_server, base, upstream__proxy=proxy, upstream__ca_file=ca_file)
        assert (await chat(server)).choices[0].message.content
    stats = await auth_proxy.stats()
    assert stats["tunnels"] >= 1 and stats["forwarded"] >= 1 and set(stats["users"]) == {"kvwarm"}


@pytest.mark.parametrize("scheme", ["https", "http"])
async def test_a_proxy_answering_407_is_a_502_naming_its_status_and_never_its_credentials(
    aiohttp_server: Any, auth_proxy: ProxyProcess, ca: trustme.CA, ca_file: str, sim: TestServer,
    caplog: pytest.LogCaptureFixture, scheme: str,
) -> None:
    """CONNECT (https) or the request itself (http) refused: the client gets a 502 that says
    what the proxy answered; the wrong password appears in no error and no log line."""
    caplog.set_level(logging.DEBUG)
    upstream = await tls_sim(aiohttp_server, ca) if scheme == "https" else sim
    wrong = "wr0ng-passw0rd"
    server = await kvwarm(
        aiohttp_server, f"{scheme}://{NAME}:{upstream.port}/v1", upstream__proxy=auth_proxy.url(f"kvwarm:{wrong}"), upstream__ca_file=ca_file
    )
    error = await refused(server)
    assert error.status_code == 502
    assert "407" in error.message and f"proxy http://127.0.0.1:{auth_proxy.port}" in error.message
    encoded = base64.b64encode(f"kvwarm:{wrong}".encode()).decode()
    for secret in (wrong, encoded):
        assert secret not in error.response.text and secret not in caplog.text
    assert received(upstream) == []


async def test_an_unreachable_proxy_is_a_502_naming_it_without_its_credentials(
    aiohttp_server: Any, unused_tcp_port: int
) -> None:
    server = await kvwarm(aiohttp_server, f"https://{NAME}/v1", upstream__proxy=f"http://kvwarm:{QUOTED_PASSWORD}@127.0.0.1:{unused_tcp_port}")
    error = await refused(server)
    assert error.status_code == 502
    assert f"through the proxy http://127.0.0.1:{unused_tcp_port}" in error.message
    assert "s3cret" not in error.response.text


# -- on uvloop -------------------------------------------------------------------------------------


def test_the_tunnel_and_tls_inside_it_work_on_uvloop(egress_proxy: ProxyProcess, ca: trustme.CA, ca_file: str) -> None:
    """``kvwarm serve`` runs on uvloop: CONNECT, then ``loop.start_tls`` on the tunnel."""
    uvloop = pytest.importorskip("uvloop")

    async def exchange() -> bytes:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert(NAME).configure_cert(context)
        async def models(request: web.Request) -> web.Response:
            return web.json_response({"loop": type(asyncio.get_running_loop()).__module__})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        port = runner.addresses[0][1]
        egress = Egress.of(load_settings(None, env={"HTTPS_PROXY": egress_proxy.url()}, overrides={"upstream.ca_file": ca_file}).upstream)
        transport = Transport(limit=4, connect_timeout=WAIT)
        try:
            url = URL(f"https://{NAME}:{port}/v1")
            response = await transport.request(transport.pool(Origin.of(url), egress.route(url)), "GET", "/v1/models", [], b"", within=WAIT)
            body = await read_chunk(response, WAIT)
            response.release()
            return body
        finally:
            await transport.close()
            await runner.cleanup()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert json.loads(runner.run(exchange())) == {"loop": "uvloop"}


# -- NO_PROXY, proxy URLs and the settings (pure) -----------------------------------------------


@pytest.mark.parametrize(
    ("no_proxy", "host", "port", "bypassed"),
    [
        ("", "api.openai.com", 443, False),
        ("*", "api.openai.com", 443, True),
        ("openai.com", "api.openai.com", 443, True),
        ("openai.com", "openai.com", 443, True),
        (".openai.com", "openai.com", 443, True),
        (".openai.com", "api.openai.com", 443, True),
        ("*.openai.com", "api.openai.com", 443, True),
        ("openai.com", "notopenai.com", 443, False),
        ("api.openai.com", "openai.com", 443, False),
        ("OpenAI.COM.", "api.openai.com", 443, True),
        ("openai.com", "API.OpenAI.com.", 443, True),
        ("localhost, 127.0.0.1", "127.0.0.1", 8000, True),
        ("localhost,127.0.0.1", "127.0.0.2", 8000, False),
        ("10.0.0.0/8", "10.1.2.3", 8000, True),
        ("10.0.0.0/8", "11.1.2.3", 8000, False),
        ("10.0.0.0/8", "10.example.com", 8000, False),
        ("::1", "::1", 8000, True),
        ("[::1]:8000", "::1", 8000, True),
        ("[::1]:8000", "::1", 8001, False),
        ("fd00::/8", "fd12::1", 443, True),
        ("vllm.internal:8000", "vllm.internal", 8000, True),
        ("vllm.internal:8000", "vllm.internal", 9000, False),
        ("127.0.0.1:8000", "127.0.0.1", 8000, True),
        ("127.0.0.1:8000", "127.0.0.1", 8001, False),
        ("a.example , ,b.example\tc.example", "c.example", 443, True),
    ],
)
def test_no_proxy_matches_as_curl_and_requests_do(no_proxy: str, host: str, port: int, bypassed: bool) -> None:
    assert NoProxy.parse(no_proxy).bypasses(host, port) is bypassed


@pytest.mark.parametrize(
    ("url", "host", "port", "credentials"),
    [
        ("http://proxy.corp:3128", "proxy.corp", 3128, None),
        ("proxy.corp:3128", "proxy.corp", 3128, None),
        ("http://proxy.corp", "proxy.corp", 80, None),
        ("http://alice:s%40cret@proxy.corp:8080/", "proxy.corp", 8080, "alice:s@cret"),
        ("http://alice@[fd00::1]:3128", "fd00::1", 3128, "alice:"),
    ],
)
def test_a_proxy_url_gives_its_address_and_basic_credentials(url: str, host: str, port: int, credentials: str | None) -> None:
    proxy = Proxy.parse(url)
    assert (proxy.host, proxy.port) == (host, port)
    if credentials is None:
        assert proxy.authorization == ""
    else:
        assert base64.b64decode(proxy.authorization.removeprefix("Basic ")).decode() == credentials
    assert "@" not in proxy.label and "alice" not in repr(proxy)


def test_the_environment_is_read_lowercase_first_and_the_file_and_keys_win(tmp_path: Path) -> None:
    env = {"HTTPS_PROXY": "http://upper:1", "https_proxy": "http://lower:2", "HTTP_PROXY": "http://plain:3", "NO_PROXY": "localhost"}
    upstream = load_settings(None, env=env).upstream
    assert (upstream.https_proxy, upstream.http_proxy, upstream.no_proxy, upstream.proxy) == (
        "http://lower:2", "http://plain:3", "localhost", None
    )
    egress = Egress.of(upstream)
    assert egress.https == Proxy(host="lower", port=2) and egress.http == Proxy(host="plain", port=3)
    assert egress.route(URL("http://localhost:8000/v1")).proxy is None

    file = tmp_path / "kvwarm.toml"
    file.write_text('[upstream]\nproxy = ""\nno_proxy = "vllm.internal"\n')
    upstream = load_settings(file, env=env).upstream
    assert (upstream.proxy, upstream.no_proxy) == ("", "vllm.internal")
    egress = Egress.of(upstream)
    assert egress.https is None and egress.http is None  # "": no proxy, whatever the environment says
    keyed = load_settings(file, env={**env, "KVWARM_UPSTREAM_PROXY": "http://keyed:4"}).upstream
    assert Egress.of(keyed).https == Proxy(host="keyed", port=4)
    assert load_settings(None, env={}).upstream.proxy is None  # unset: the environment's (none here)


@pytest.mark.parametrize(
    ("settings", "key", "fragment"),
    [
        ({"upstream.proxy": "socks5://alice:hunter2@proxy:1080"}, "upstream.proxy", "only http:// proxies"),
        ({"upstream.proxy": "https://alice:hunter2@proxy:443"}, "upstream.proxy", "only http:// proxies"),
        ({"upstream.proxy": "http://alice:hunter2@proxy:99999"}, "upstream.proxy", "port"),
        ({"upstream.proxy": "http://alice:hunter2@proxy:3128/path"}, "upstream.proxy", "without a path"),
        ({"upstream.proxy": "socks5://alice:hun/ter2@proxy:1080"}, "upstream.proxy", "only http:// proxies"),
        ({"upstream.https_proxy": "socks5h://alice:hunter2@proxy:1080"}, "upstream.https_proxy", "HTTPS_PROXY"),
        ({"upstream.idle_connection_timeout": 0}, "upstream.idle_connection_timeout", "positive"),
        ({"upstream.ca_file": "/nonexistent/ca.pem"}, "upstream.ca_file", "/nonexistent/ca.pem"),
        ({"upstream.client_key": "/nonexistent/key.pem"}, "upstream.client_key", "without client_cert"),
        ({"upstream.client_cert": "/nonexistent/cert.pem"}, "upstream.client_cert", "/nonexistent/cert.pem"),
    ],
)
def test_a_bad_egress_setting_names_its_key_and_never_the_credentials(settings: dict[str, Any], key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(None, env={}, overrides=settings)
    assert caught.value.key == key
    assert fragment in str(caught.value)
    assert "hunter2" not in str(caught.value) and "ter2" not in str(caught.value)


def test_an_unused_environment_proxy_is_not_checked_when_upstream_proxy_is_set() -> None:
    """An ALL-purpose socks5 proxy in the environment does not stop kvwarm once
    ``upstream.proxy`` says what kvwarm uses."""
    settings = load_settings(None, env={"HTTPS_PROXY": "socks5://proxy:1080"}, overrides={"upstream.proxy": ""})
    assert Egress.of(settings.upstream).https is None


async def test_a_connect_refusal_is_a_proxy_refused_with_the_status(auth_proxy: ProxyProcess) -> None:
    transport = Transport(limit=4, connect_timeout=WAIT)
    try:
        pool = transport.pool(Origin(host=NAME, port=443, tls=True), Route(proxy=Proxy(host="127.0.0.1", port=auth_proxy.port)))
        with pytest.raises(ProxyRefused) as caught:
            await transport.request(pool, "GET", "/v1/models", [], b"", within=WAIT)
        assert caught.value.status == 407
    finally:
        await transport.close()
