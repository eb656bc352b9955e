"""``metrics.token``: when set, the metrics path answers only ``Authorization: Bearer <token>``.

Off by default (Prometheus exporters usually are open); today there is no such setting and
``/metrics`` answers everyone.
"""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestServer

from tests.conftest import ProxyFactory
from tests.reliability.conftest import exchange, get

TOKEN = "scrape-token-123"


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer "],
)
async def test_metrics_need_the_token(make_proxy: ProxyFactory, sim: TestServer, authorization: str | None) -> None:
    proxy = await make_proxy(sim, metrics__token=TOKEN)
    extra = f"Authorization: {authorization}\r\n" if authorization is not None else ""
    response = await exchange(proxy.port, get("/metrics", extra=extra))
    assert response.status == 401, response
    assert response.error()["code"] == "unauthorized"
    assert b"kvwarm_" not in response.body


async def test_metrics_with_the_token(make_proxy: ProxyFactory, sim: TestServer) -> None:
    proxy = await make_proxy(sim, metrics__token=TOKEN)
    response = await exchange(proxy.port, get("/metrics", extra=f"Authorization: Bearer {TOKEN}\r\n"))
    assert response.status == 200
    assert b"kvwarm_requests_total" in response.body or b"kvwarm_build_info" in response.body


async def test_metrics_are_open_by_default(make_proxy: ProxyFactory, sim: TestServer) -> None:
    proxy = await make_proxy(sim)
    response = await exchange(proxy.port, get("/metrics"))
    assert response.status == 200 and b"kvwarm_build_info" in response.body
