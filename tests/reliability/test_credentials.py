"""With ``upstream.api_key`` set, no client credential travels upstream; without it, they pass through.

A real upstream records the headers it receives. Today kvwarm replaces ``Authorization`` but
forwards the client's ``X-Api-Key``, ``api-key``, ``x-goog-api-key`` and ``Cookie``: a client's
own key (or session cookie) reaches the provider beside the operator's.
"""

from __future__ import annotations

from aiohttp.test_utils import TestServer

from tests.conftest import ProxyFactory
from tests.reliability.conftest import Recorder, exchange

CLIENT_CREDENTIALS = {
    "Authorization": "Bearer sk-client-own-key",
    "Proxy-Authorization": "Basic Y2xpZW50OnNlY3JldA==",
    "X-Api-Key": "client-x-api-key",
    "api-key": "client-azure-key",
    "x-goog-api-key": "client-google-key",
    "Cookie": "session=client-cookie",
}


def request_with(headers: dict[str, str]) -> bytes:
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return f"GET /v1/models HTTP/1.1\r\nHost: kvwarm\r\nX-Trace: t1\r\n{lines}\r\n".encode()


async def test_no_client_credential_reaches_the_upstream_when_kvwarm_holds_the_key(
    make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer]
) -> None:
    rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/v1")), upstream__api_key="sk-operator")
    assert (await exchange(proxy.port, request_with(CLIENT_CREDENTIALS))).status == 200
    (sent,) = rec.headers
    lowered = {k.lower(): v for k, v in sent.items()}
    assert lowered["authorization"] == "Bearer sk-operator"
    for name, value in CLIENT_CREDENTIALS.items():
        assert value not in sent.values(), f"{name} travelled upstream"
        if name.lower() != "authorization":
            assert name.lower() not in lowered
    assert lowered["x-trace"] == "t1", "other headers still pass"


async def test_without_an_api_key_the_clients_credentials_pass_through(
    make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer]
) -> None:
    rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/v1")))
    assert (await exchange(proxy.port, request_with(CLIENT_CREDENTIALS))).status == 200
    (sent,) = rec.headers
    lowered = {k.lower(): v for k, v in sent.items()}
    for name, value in CLIENT_CREDENTIALS.items():
        if name == "Proxy-Authorization":  # hop-by-hop: never forwarded
            assert name.lower() not in lowered
        else:
            assert lowered[name.lower()] == value
