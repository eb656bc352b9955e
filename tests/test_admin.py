"""The /kvwarm/ admin API: who sees what, and exact views of a session.

Most tests run through the real proxy on loopback. Non-loopback access is tested for
real where the machine has a non-loopback address: the proxy is bound to it and the
test connects to it, so ``request.remote`` is that address (no mock, no header trick);
the access rules themselves are also tested as a pure function over made-up peers.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.core import transcript_md
from proxy.core.match import tenant_root
from proxy.errors import AdminUnauthorized
from proxy.ops.admin import decide_access, is_loopback
from tests.agents import Agent
from tests.conftest import ProxyFactory, poster, proxy_settings, sim_url, store_of

SECRET = b"s" * 32




async def get(server: TestServer, path: str, **headers: str) -> tuple[int, bytes, str]:
    async with aiohttp.ClientSession() as s, s.get(server.make_url(path), headers=headers) as r:
        return r.status, await r.read(), r.headers.get("Content-Type", "")


async def listed(server: TestServer, **headers: str) -> set[str]:
    status, body, _ = await get(server, "/kvwarm/sessions", **headers)
    assert status == 200, body
    return {s["id"] for s in orjson.loads(body)["data"]}


# -- the rules, as a function of peer and headers ----------------------------------------------


def settings(**overrides: Any) -> Any:
    return proxy_settings("http://127.0.0.1:1/v1", **overrides)


@pytest.mark.parametrize(
    ("remote", "expected"),
    [("127.0.0.1", True), ("127.8.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
     ("192.0.2.7", False), ("::ffff:192.0.2.7", False), ("fe80::1%eth0", False), ("", False), (None, False),
     ("not-an-ip", False)],
)
def test_is_loopback(remote: str | None, expected: bool) -> None:
    assert is_loopback(remote) is expected


ALICE = {"Authorization": "Bearer sk-alice"}
ADMIN = {"Authorization": "Bearer t0ken"}


@pytest.mark.parametrize(
    ("remote", "headers", "overrides", "expected"),
    [
        # Loopback: the operator sees all; a tenant key narrows to its tenant.
        ("127.0.0.1", {}, {}, "all"),
        ("::1", ALICE, {}, "alice"),
        ("127.0.0.1", ADMIN, {"admin.token": "t0ken"}, "all"),
        ("192.0.2.7", {"authorization": "bearer t0ken"}, {"admin.token": "t0ken"}, "all"),  # names and scheme: any case
        # A wrong admin token is some tenant's key as far as anyone can tell: that tenant only.
        ("192.0.2.7", {"Authorization": "Bearer t0ken2"}, {"admin.token": "t0ken"}, "wrong-token"),
        # A reverse proxy on the host relays remote clients from loopback: not the operator.
        ("127.0.0.1", {"X-Forwarded-For": "203.0.113.9"}, {}, 401),
        ("127.0.0.1", {"Forwarded": "for=203.0.113.9"}, {}, 401),
        ("127.0.0.1", {"X-Real-IP": "203.0.113.9", **ALICE}, {}, 401),
        # Beyond loopback, only once admin.token opens the API.
        ("192.0.2.7", {}, {}, 401),
        ("192.0.2.7", ALICE, {}, 401),
        ("192.0.2.7", {}, {"admin.token": "t0ken"}, 401),
        ("192.0.2.7", ADMIN, {"admin.token": "t0ken"}, "all"),
        ("192.0.2.7", {"Authorization": "Bearer t0ken"}, {}, 401),  # no token configured: nothing matches it
        ("192.0.2.7", ALICE, {"admin.token": "t0ken"}, "alice"),
        # ...and only where the credential proves the tenant.
        ("192.0.2.7", ALICE, {"admin.token": "t0ken", "upstream.api_key": "sk-shared"}, 401),
        ("192.0.2.7", {"X-Tenant": "alice"}, {"admin.token": "t0ken", "store.tenant_header": "X-Tenant"}, 401),
        # With a tenant header, that header is the tenant (on loopback).
        ("127.0.0.1", {"X-Tenant": "alice", **ALICE}, {"store.tenant_header": "X-Tenant"}, "alice-header"),
    ],
)
def test_access_rules(remote: str, headers: dict[str, str], overrides: dict[str, Any], expected: object) -> None:
    s = settings(**overrides)
    request_headers = CIMultiDict(headers)  # as aiohttp hands them over: names in any case
    if expected == 401:
        with pytest.raises(AdminUnauthorized):
            decide_access(remote, request_headers, s, lambda: SECRET)
        return
    access = decide_access(remote, request_headers, s, lambda: SECRET)
    roots = {
        "all": None,
        "alice": tenant_root(SECRET, "Bearer sk-alice"),
        "alice-header": tenant_root(SECRET, "alice"),
        "wrong-token": tenant_root(SECRET, "Bearer t0ken2"),
    }
    assert access.tenant == roots[str(expected)]


# -- through the real proxy ------------------------------------------------------------------


async def test_a_tenant_never_sees_another_tenants_sessions(make_proxy: ProxyFactory, sim: TestServer) -> None:
    proxy = await make_proxy(sim)
    await Agent(poster(proxy, "sk-alice")).run(2)
    await Agent(poster(proxy, "sk-bob")).run(2)
    await Agent(poster(proxy, "sk-bob"), system="Another system prompt.").run(1)

    alice = await listed(proxy, Authorization="Bearer sk-alice")
    bob = await listed(proxy, Authorization="Bearer sk-bob")
    everyone = await listed(proxy)  # loopback, no credential: the operator
    assert len(alice) == 1 and len(bob) == 2
    assert not alice & bob
    assert everyone == alice | bob
    assert await listed(proxy, Authorization="Bearer sk-mallory") == set()

    (bobs, *_) = bob
    status, body, _ = await get(proxy, f"/kvwarm/sessions/{bobs}", Authorization="Bearer sk-alice")
    assert status == 404 and orjson.loads(body)["error"]["code"] == "session_not_found"
    status, _, _ = await get(proxy, f"/kvwarm/sessions/{bobs}.md", Authorization="Bearer sk-alice")
    assert status == 404
    status, _, _ = await get(proxy, f"/kvwarm/sessions/{bobs}", Authorization="Bearer sk-bob")
    assert status == 200


async def test_session_views_are_exact(make_proxy: ProxyFactory, sim: TestServer) -> None:
    proxy = await make_proxy(sim)
    await Agent(poster(proxy, "sk-alice")).run(3)
    store = store_of(proxy)
    (info,) = store.sessions()
    nodes = store.path(info.leaf)
    sid = info.leaf.hex()

    status, body, ctype = await get(proxy, "/kvwarm/sessions")
    assert status == 200 and ctype.startswith("application/json")
    (row,) = orjson.loads(body)["data"]
    assert row["id"] == sid and row["turns"] == 3 and row["messages"] == len(nodes) - 1
    assert row["prompt_tokens"] > 0 and row["cached_tokens"] > 0 and 0 < row["cache_hit_pct"] < 100
    assert row["model"] == "kvwarm-sim" and row["created"] <= row["updated"]

    status, body, _ = await get(proxy, f"/kvwarm/sessions/{sid}")
    assert status == 200
    detail = orjson.loads(body)
    assert [e["identity"] for e in detail["elements"]] == [n.identity.hex() for n in nodes]
    for node in nodes:  # each stored body appears verbatim, not re-serialized
        assert node.body in body
    assert [e["role"] for e in detail["elements"]][:3] == ["tools", "system", "user"]

    status, md, ctype = await get(proxy, f"/kvwarm/sessions/{sid}.md")
    assert status == 200 and ctype.startswith("text/markdown")
    back = transcript_md.parse(md)
    assert [n.body for n in back.nodes] == [n.body for n in nodes]
    assert [n.key for n in back.nodes] == [n.key for n in nodes]
    assert (await get(proxy, f"/kvwarm/sessions/{sid[:8]}?format=md"))[1] == md

    assert (await get(proxy, "/kvwarm/sessions/" + "0" * 32))[0] == 404
    assert (await get(proxy, f"/kvwarm/sessions/{sid}?format=xml"))[0] == 400
    assert (await get(proxy, "/kvwarm/sessions?limit=0"))[0] == 400
    assert (await get(proxy, "/kvwarm/sessions?limit=%C2%B2"))[0] == 400  # '²' is a digit to str.isdigit
    status, body, _ = await get(proxy, "/kvwarm/sessions?limit=1")
    assert status == 200 and orjson.loads(body)["has_more"] is False


async def test_forwarded_request_on_loopback_is_refused(make_proxy: ProxyFactory, sim: TestServer) -> None:
    proxy = await make_proxy(sim)
    status, body, ctype = await get(proxy, "/kvwarm/sessions", **{"X-Forwarded-For": "203.0.113.9"})
    assert status == 401 and ctype.startswith("application/json")
    error = orjson.loads(body)["error"]
    assert error["code"] == "unauthorized" and "admin.token" in error["message"]


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (the source of its default route)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            address: str = s.getsockname()[0]
    except OSError:
        return None
    return None if ipaddress.ip_address(address).is_loopback else address


@pytest.mark.parametrize("token", ["", "t0ken"])
async def test_non_loopback_client_needs_the_admin_token(aiohttp_server: Any, sim: TestServer, token: str) -> None:
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    app = create_app(proxy_settings(sim_url(sim), **{"admin.token": token}), registry=CollectorRegistry())
    proxy: TestServer = await aiohttp_server(app, host=address)
    await Agent(poster(proxy, "sk-alice")).run(1)
    await Agent(poster(proxy, "sk-bob")).run(1)

    status, body, _ = await get(proxy, "/kvwarm/sessions")
    assert status == 401 and orjson.loads(body)["error"]["type"] == "invalid_request_error"
    status, _, _ = await get(proxy, "/kvwarm/sessions", Authorization="Bearer sk-alice")
    if not token:
        assert status == 401  # loopback only until the operator sets admin.token
        return
    assert status == 200
    alice = await listed(proxy, Authorization="Bearer sk-alice")
    everyone = await listed(proxy, Authorization=f"Bearer {token}")
    assert len(alice) == 1 and len(everyone) == 2 and alice < everyone
    assert await listed(proxy, Authorization="Bearer not-the-token") == set()
