"""The /kvwarm/ page in a real headless Chromium, in front of the reference upstream.

kvwarm runs as the real app (``create_app``, memory store, fresh registry) on a real
loopback socket; drifting agents talk to it through the official openai SDK; Chromium
(Debian's, driven over the DevTools protocol) loads the page. What the page shows is
compared with ``/metrics`` and the admin API, read independently. Skipped, saying how
to install it, when there is no Chromium.

Screenshots for the docs (``docs/img/dashboard.png``, ``docs/img/dashboard-narrow.png``) are
rewritten with ``KVWARM_SCREENSHOTS=1 pytest tests/web -k metrics`` (or when missing).
"""

from __future__ import annotations

import asyncio
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.appkeys import ACTIVITY, HISTORY, STORE
from proxy.config import load_settings
from proxy.core.match import tenant_root
from tests.agents import args_keys_reordered, no_drift, resumed, tools_reordered
from tests.conftest import ProxyFactory, sim_url, store_of
from tests.demo.run import SEMANTIC, now_stamp, timestamp_in_system
from tests.web.cdp import Chromium, Page, chromium_binary
from tests.web.workload import (
    READ_PAGE,
    break_headers,
    by_label,
    feed_breaks_unless_wired,
    get_json,
    run_agents,
    scrape,
    tool_result_edited,
    total,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS_SHOTS = ROOT / "docs" / "img"
SHOT_NAMES = ("dashboard.png", "dashboard-narrow.png")


def shots_dir(tmp_path: Path) -> Path:
    """Where the screenshots go: ``docs/img`` when ``KVWARM_SCREENSHOTS=1`` or they are missing
    there, else the test's temporary directory (taken all the same, without dirtying the tree)."""
    if os.environ.get("KVWARM_SCREENSHOTS") == "1" or not all((DOCS_SHOTS / n).exists() for n in SHOT_NAMES):
        return DOCS_SHOTS
    return tmp_path / "img"
LIVE_TEXT = {"process", "generated"}
"""Text slots that move by themselves between two reads (uptime, clock)."""
LIVE_FIELDS = {"updated", "seen"}
"""Row fields that do (ages)."""


CUT_OFF = """[...document.querySelectorAll('body *')]
  .filter((el) => !el.closest('pre') && el.getBoundingClientRect().right > window.innerWidth + 0.5)
  .map((el) => `${el.tagName}.${el.className} ${el.textContent.slice(0, 40)}`)"""
"""Elements reaching past the viewport's right edge (clipped by a panel, or scrolling the page);
a ``pre`` scrolls by itself, so what is inside one may."""


def count(value: float) -> str:
    return f"{round(value):,}"


def pct(num: float, den: float) -> str:
    return f"{100.0 * num / den:.1f} %"


def usd(value: float) -> str:
    return f"${value:.4f}" if value < 1 else f"${value:,.2f}"


def not_favicon(errors: list[str]) -> list[str]:
    """``errors`` but the 404 of ``/favicon.ico``, which Chromium asks for on a plain-text
    document (the transcript is the admin API's Markdown, not an HTML page with an icon)."""
    return [e for e in errors if not e.endswith("/favicon.ico")]


async def read(page: Page) -> dict[str, Any]:
    shown: dict[str, Any] = await page.evaluate(READ_PAGE)
    return shown


def steady(shown: dict[str, Any]) -> dict[str, Any]:
    """``shown`` without what changes with the clock alone."""
    return {
        "text": {k: v for k, v in shown["text"].items() if k not in LIVE_TEXT},
        "lists": {
            name: [{f: v for f, v in row.items() if f not in LIVE_FIELDS} for row in rows]
            for name, rows in shown["lists"].items()
        },
        "empty": shown["empty"],
    }


async def test_page_shows_what_metrics_say(
    make_proxy: ProxyFactory, sim: TestServer, openai_client: Any, tmp_path: Path
) -> None:
    chromium_binary()
    kvwarm = await make_proxy(sim)
    agents = {
        "baseline: no drift": ("sk-team-baseline", no_drift),
        "tools reordered": ("sk-team-tools", tools_reordered),
        "argument keys reordered": ("sk-team-args", args_keys_reordered),
        "resumed": ("sk-team-resume", resumed),
        SEMANTIC: ("sk-team-clock", timestamp_in_system),
        "tool results re-rendered": ("sk-team-edits", tool_result_edited),
    }
    runs = await run_agents(kvwarm, openai_client, agents, turns=5)
    wired = feed_breaks_unless_wired(kvwarm, runs)
    headers = break_headers(runs)
    assert any(h["reason"] == "system_changed" for _, h in headers), headers

    metrics = await scrape(kvwarm)
    cached = total(metrics, "kvwarm_cached_prompt_tokens_total")
    known = total(metrics, "kvwarm_cache_known_prompt_tokens_total")
    rescued = total(metrics, "kvwarm_repair_rescued_tokens_total")
    breaks = by_label(metrics, "kvwarm_prefix_breaks_total", "reason")
    billed = total(metrics, "kvwarm_cost_usd_total", source="billed")
    estimated = total(metrics, "kvwarm_cost_usd_total", source="estimated")
    written = total(metrics, "kvwarm_cache_write_tokens_total")
    saved = total(metrics, "kvwarm_cache_savings_usd_total")
    saved_by_repair = total(metrics, "kvwarm_cache_savings_usd_total", by="repair")
    premium = total(metrics, "kvwarm_cache_write_premium_usd_total")
    assert cached > 0 and rescued > 0 and estimated > 0
    assert saved > saved_by_repair > 0
    assert breaks.get("system_changed", 0) > 0 and breaks.get("content_changed", 0) > 0

    async with Chromium.launch(tmp_path / "chromium") as browser:
        page = await browser.page()
        await page.viewport(1280, 900)
        await page.navigate(str(kvwarm.make_url("/kvwarm/")))
        shown = await read(page)
        text, lists = shown["text"], shown["lists"]

        # The numbers are /metrics' numbers.
        assert shown["scope"] == "all"
        assert text["hit_total"] == pct(cached, known)
        assert text["hit_tokens"] == f"{count(cached)} of {count(known)} prompt tokens cached"
        assert text["requests"] == count(total(metrics, "kvwarm_requests_total"))
        assert text["rescued"] == count(rescued)
        assert text["breaks_total"] == count(sum(breaks.values()))
        assert {r["reason"]: r["count"] for r in lists["breaks"]} == {k: count(v) for k, v in breaks.items() if v}
        assert text["cost_today"] == usd(billed + estimated)
        assert text["cache_rw"] == f"{count(cached)} read · {count(written)} written to the cache"
        assert text["saved_today"] == usd(saved - premium)
        assert text["saved_split"] == f"reads saved {usd(saved)} · writes cost {usd(premium)} extra"
        assert text["saved_repair"] == f"{usd(saved_by_repair)} of it by repairs"
        assert text["cost_split"] == f"billed {usd(billed)} · estimated {usd(estimated)}"
        prompt, completion = (total(metrics, f"kvwarm_{n}_tokens_total") for n in ("prompt", "completion"))
        assert text["tokens_note"] == f"{count(prompt)} prompt · {count(completion)} completion tokens"
        assert text["upstream"] == f"one upstream: {sim_url(sim)}"
        line = await page.evaluate("document.querySelector('[data-d=chart_line]').getAttribute('d') + "
                                   "document.querySelector('[data-d=chart_dots]').getAttribute('d')")
        assert line.startswith("M"), "the hit % chart has no point for the traffic just sent"

        # The break example names the change's shape and the exact line that pins it.
        clock = [e for e in lists["examples"] if e["reason"] == "system_changed"]
        assert clock, lists["examples"]
        header = next(h for _, h in headers if h["reason"] == "system_changed")
        assert (clock[0]["where"], clock[0]["shape"]) == (header["where"], header["shape"])
        pin = clock[0]["pin"]
        assert tomllib.loads(pin) == {"system": [header["hint"]]}
        assert re.fullmatch(header["hint"], now_stamp())

        # The sessions are the store's, biggest first, each linked to its transcript.
        status, listing = await get_json(kvwarm, "/kvwarm/sessions")
        assert status == 200
        biggest = sorted(listing["data"], key=lambda s: -(s["prompt_tokens"] + s["completion_tokens"]))
        rows = lists["sessions"]
        assert [r["href"] for r in rows] == [f"/kvwarm/sessions/{s['id']}.md" for s in biggest[: len(rows)]]
        assert rows[0]["tokens"] == count(biggest[0]["prompt_tokens"] + biggest[0]["completion_tokens"])
        assert rows[0]["hit"] == f"{biggest[0]['cache_hit_pct']:.1f} %"

        # The script re-binds the polled view into the same slots: nothing changes but the clock.
        await page.evaluate("window.kvwarm.refresh()", await_promise=True)
        assert steady(await read(page)) == steady(shown)
        assert await page.evaluate("document.getElementById('status').textContent") == ""
        assert page.errors == [], page.errors

        # Screenshots for the docs: wide and light, narrow and dark.
        shots = shots_dir(tmp_path)
        await page.screenshot(shots / "dashboard.png", 1280)
        light = await page.evaluate("getComputedStyle(document.body).backgroundColor")
        await page.color_scheme("dark")
        dark = await page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert dark != light
        await page.viewport(380, 800, mobile=True, scale=2)
        await page.evaluate("window.kvwarm.refresh()", await_promise=True)
        overflow = await page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow}px wider than a 380px screen"
        assert await page.evaluate(CUT_OFF) == [], "elements cut off at the right edge of a 380px screen"
        await page.screenshot(shots / "dashboard-narrow.png", 380, mobile=True, scale=2, max_height=1600)
        await page.color_scheme("light")

        # The transcript link opens the readable transcript.
        loaded = page.expect("Page.loadEventFired")
        await page.evaluate("document.querySelector('[data-list=sessions] a').click()")
        await loaded
        body = await page.evaluate("document.body.innerText")
        assert f"# Session {biggest[0]['id']}" in body
        assert "Agent profile:" in body
        assert not_favicon(page.errors) == [], page.errors

    if wired:  # the request path notes breaks itself: its examples are the headers' spans
        noted = {(e.where, e.shape, e.hint) for e in kvwarm.app[ACTIVITY].examples()}
        assert {(h["where"], h["shape"], h["hint"]) for _, h in headers} <= noted


async def test_the_pin_line_pasted_into_config_stops_the_break(
    make_proxy: ProxyFactory, sim: TestServer, openai_client: Any, aiohttp_server: Any, tmp_path: Path
) -> None:
    """The pin line the page shows, pasted under [repair.pin_patterns], is a config kvwarm loads,
    and with it the timestamp agent no longer breaks its prefix."""
    kvwarm = await make_proxy(sim)
    runs = await run_agents(kvwarm, openai_client, {SEMANTIC: ("sk-clock", timestamp_in_system)}, turns=3)
    feed_breaks_unless_wired(kvwarm, runs)
    status, overview = await get_json(kvwarm, "/kvwarm/api/overview")
    assert status == 200
    pin = next(e["pin_line"] for e in overview["examples"] if e["reason"] == "system_changed")
    assert overview["view"]["lists"]["examples"][0]["pin"] == pin

    config = tmp_path / "kvwarm.toml"
    config.write_text(f"[repair.pin_patterns]\n{pin}\n", encoding="utf-8")
    settings = load_settings(config, env={}, overrides={"store.backend": "memory", "upstream.base_url": sim_url(sim)})
    pinned = await aiohttp_server(create_app(settings, registry=CollectorRegistry()))
    await run_agents(pinned, openai_client, {SEMANTIC: ("sk-clock", timestamp_in_system)}, turns=3)
    metrics = await scrape(pinned)
    assert total(metrics, "kvwarm_requests_total") == 3
    assert total(metrics, "kvwarm_prefix_breaks_total") == 0
    assert total(metrics, "kvwarm_cached_prompt_tokens_total") > 0


async def test_a_tenant_sees_only_its_own_sessions(
    make_proxy: ProxyFactory, sim: TestServer, openai_client: Any, tmp_path: Path
) -> None:
    chromium_binary()
    kvwarm = await make_proxy(sim)
    runs = await run_agents(
        kvwarm,
        openai_client,
        {SEMANTIC: ("sk-alice", timestamp_in_system), "bob's clock": ("sk-bob", timestamp_in_system)},
        turns=3,
    )
    feed_breaks_unless_wired(kvwarm, runs)
    store = store_of(kvwarm)
    alice, bob = (tenant_root(store.secret(), f"Bearer {k}") for k in ("sk-alice", "sk-bob"))
    alice_ids = {s.leaf.hex() for s in store.sessions(alice)}
    bob_ids = {s.leaf.hex() for s in store.sessions(bob)}
    assert alice_ids and bob_ids

    # The API: process-wide numbers are the operator's; a tenant gets its own sessions and examples.
    status, mine = await get_json(kvwarm, "/kvwarm/api/overview", Authorization="Bearer sk-alice")
    assert status == 200 and mine["scope"] == "tenant"
    assert mine["totals"] is None and mine["history"] is None and mine["today"] is None
    assert {s["id"] for s in mine["sessions"]} == alice_ids
    assert mine["examples"] and {e["tenant"] for e in mine["examples"]} == {alice.hex()}
    assert mine["mine"]["turns"] == 3
    status, everything = await get_json(kvwarm, "/kvwarm/api/overview")
    assert status == 200 and {s["id"] for s in everything["sessions"]} == alice_ids | bob_ids
    assert {e["tenant"] for e in everything["examples"]} == {alice.hex(), bob.hex()}

    async with Chromium.launch(tmp_path / "chromium") as browser:
        page = await browser.page()
        await page.send("Network.enable")
        await page.send("Network.setExtraHTTPHeaders", headers={"Authorization": "Bearer sk-alice"})
        await page.navigate(str(kvwarm.make_url("/kvwarm/")))
        await page.evaluate("window.kvwarm.refresh()", await_promise=True)
        shown = await read(page)
        html = await page.evaluate("document.documentElement.outerHTML")
        assert shown["scope"] == "tenant"
        assert "hit_total" not in shown["text"]
        assert shown["text"]["mine_sessions"] == count(len(alice_ids))
        assert {r["href"] for r in shown["lists"]["sessions"]} == {f"/kvwarm/sessions/{i}.md" for i in alice_ids}
        assert not any(i in html for i in bob_ids) and bob.hex() not in html
        assert [r["reason"] for r in shown["lists"]["breaks"]] == ["system_changed"]
        assert page.errors == [], page.errors

        loaded = page.expect("Page.loadEventFired")
        await page.evaluate("document.querySelector('[data-list=sessions] a').click()")
        await loaded
        assert "# Session " in await page.evaluate("document.body.innerText")
        assert not_favicon(page.errors) == [], page.errors

        # Another tenant's transcript is absent for alice.
        await page.navigate(str(kvwarm.make_url(f"/kvwarm/sessions/{next(iter(bob_ids))}.md")))
        assert "no session" in await page.evaluate("document.body.innerText")


async def test_who_may_load_the_page(make_proxy: ProxyFactory, sim: TestServer) -> None:
    """The admin API's rule: behind a reverse proxy (a forwarding header), loopback is not enough."""
    kvwarm = await make_proxy(sim, admin__token="the-admin-token")
    forwarded = {"X-Forwarded-For": "192.0.2.7"}
    async with aiohttp.ClientSession() as s:
        for path in ("/kvwarm/", "/kvwarm/api/overview"):
            async with s.get(kvwarm.make_url(path), headers=forwarded) as r:
                assert r.status == 401, path
                assert "admin.token" in (await r.json())["error"]["message"]
            async with s.get(
                kvwarm.make_url(path), headers={**forwarded, "Authorization": "Bearer the-admin-token"}
            ) as r:
                assert r.status == 200, path
        async with s.get(kvwarm.make_url("/kvwarm/api/overview")) as r:
            assert r.status == 200 and (await r.json())["access"] == "loopback"
        async with s.get(kvwarm.make_url("/kvwarm"), allow_redirects=False) as r:
            assert r.status == 302 and r.headers["Location"] == "/kvwarm/"
        async with s.get(kvwarm.make_url("/kvwarm/static/dashboard.js"), headers=forwarded) as r:
            assert r.status == 200 and r.content_type == "text/javascript"
            etag = r.headers["ETag"]
        async with s.get(kvwarm.make_url("/kvwarm/static/dashboard.js"), headers={"If-None-Match": etag}) as r:
            assert r.status == 304
        async with s.get(kvwarm.make_url("/kvwarm/static/nothing.js")) as r:
            assert r.status == 404


HOSTILE_MODEL = '<img src=x onerror="window.__pwned=1">'
HOSTILE_PROMPT = "</script><script>window.__pwned=2</script><b>bold?</b> & \"quotes\" 'too'"


async def test_hostile_names_and_prompts_are_shown_as_text(
    make_proxy: ProxyFactory, sim: TestServer, openai_client: Any, tmp_path: Path
) -> None:
    chromium_binary()
    kvwarm = await make_proxy(sim)
    client = openai_client(kvwarm, api_key="sk-mallory")
    await client.chat.completions.create(model=HOSTILE_MODEL, messages=[{"role": "user", "content": HOSTILE_PROMPT}])
    kvwarm.app[ACTIVITY].note_break(
        tenant_root(kvwarm.app[STORE].secret(), "Bearer sk-mallory"),
        "content_changed", "messages[0]", "<svg onload=alert(1)>", "'</x>\n", 0.0, role="us'er",
    )
    async with Chromium.launch(tmp_path / "chromium") as browser:
        page = await browser.page()
        await page.navigate(str(kvwarm.make_url("/kvwarm/")))
        for _ in range(2):  # as the server rendered it, then as the script re-bound it
            shown = await read(page)
            row = shown["lists"]["sessions"][0]
            assert row["model"] == HOSTILE_MODEL
            assert row["preview"] == HOSTILE_PROMPT
            example = shown["lists"]["examples"][0]
            assert example["shape"] == "<svg onload=alert(1)>"
            assert tomllib.loads(example["pin"]) == {"us'er": ["'</x>\n"]}
            injected = await page.evaluate(
                "[window.__pwned, document.querySelectorAll('main img, main script, main svg:not(.chart), main b').length]"
            )
            assert injected == [None, 0]
            await page.evaluate("window.kvwarm.refresh()", await_promise=True)
        assert page.errors == [], page.errors
    status, overview = await get_json(kvwarm, "/kvwarm/api/overview")
    assert status == 200 and orjson.dumps(overview["sessions"][0]["model"]) == orjson.dumps(HOSTILE_MODEL)


async def test_the_sampler_is_owned_by_the_app(make_proxy: ProxyFactory, sim: TestServer) -> None:
    """A first reading at start-up, one task sampling while the app runs, none after it stops."""

    def samplers() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if t.get_name() == "kvwarm-web-history" and not t.done()]

    kvwarm = await make_proxy(sim)
    assert len(kvwarm.app[HISTORY]) == 1 and len(samplers()) == 1
    await kvwarm.close()
    assert samplers() == []
