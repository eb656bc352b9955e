"""The live page's replicas section, in a real headless Chromium, for a pool with one replica down."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.demo.run import sdk_post
from tests.routing.conftest import PooledFactory, PoolFactory, router_of, session_agent
from tests.web.cdp import Chromium, chromium_binary
from tests.web.workload import READ_PAGE

OVERFLOW = "document.documentElement.scrollWidth - window.innerWidth"


async def test_the_page_lists_each_replica_with_its_health_and_load(
    make_pool: PoolFactory, make_pooled: PooledFactory, openai_client: Any, tmp_path: Path, closed_port_url: Callable[[], str]
) -> None:
    chromium_binary()  # skips, saying how to install it, when there is no Chromium
    replicas = await make_pool(2)
    dead = closed_port_url()
    kvwarm = await make_pooled([replicas[0], dead, replicas[1]])
    client = openai_client(kvwarm)
    await session_agent(0, sdk_post(client), prompt=0).run(2)
    await session_agent(1, sdk_post(client), prompt=1).run(2)
    for _ in range(3):  # requests kvwarm does not read rotate over the replicas: the dead one is tried
        assert [m.id async for m in client.models.list()] == ["kvwarm-sim"]
    router = router_of(kvwarm)

    async with Chromium.launch(tmp_path / "chromium") as browser:
        page = await browser.page()
        await page.viewport(1280, 900)
        await page.navigate(str(kvwarm.make_url("/kvwarm/")))
        shown = await page.evaluate(READ_PAGE)
        rows = shown["lists"]["upstreams"]
        assert [r["url"] for r in rows] == [d["url"] for d in router.describe()]
        assert [r["state"] for r in rows] == ["healthy", "ejected", "healthy"]
        assert [int(r["requests"]) for r in rows] == [r.requests for r in router.replicas]
        assert sum(int(r["requests"]) for r in rows) == 4 + 3 and all(r["inflight"] == "0" for r in rows)
        assert rows[1]["requests"] == "0" and rows[1]["ejections"] == "1"
        assert shown["text"]["upstream"].startswith("3 replicas, 2 healthy")
        assert await page.evaluate("document.querySelector('table.replicas').hidden") is False
        await page.viewport(380, 800, mobile=True, scale=2)
        await page.evaluate("window.kvwarm.refresh()", await_promise=True)
        assert await page.evaluate(OVERFLOW) <= 0, "the replicas table fits a 380px screen"
        assert page.errors == [], page.errors
