"""The dashboard's pure parts: counters read back, the per-minute ring, break examples, the view."""

from __future__ import annotations

import re
import tomllib
from datetime import datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from proxy.core.policy import Policy
from proxy.core.pricing import Cost, Price, cost_of
from proxy.core.usage import Usage
from proxy.metrics import ProxyMetrics
from proxy.store.base import SessionInfo
from proxy.store.local import LocalStore
from proxy.store.memory.store import MemoryStore
from proxy.web.activity import Activity, pin_line, toml_string
from proxy.web.counters import ZERO, Reading, Totals, read_counters
from proxy.web.history import History
from proxy.web.overview import Viewer, build_overview, display_url, local_midnight, window_minutes
from proxy.web.routes import SessionReads
from proxy.web.view import build_view, chart_paths, fmt_age, fmt_count, fmt_pct, fmt_usd

T0 = 1_800_000_000.0 - 1_800_000_000.0 % 60
"""A whole minute."""

# -- counters ---------------------------------------------------------------------------------


def usage(prompt: int, cached: int | None, completion: int = 10) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached, cache_write_tokens=None,
                 reasoning_tokens=None, billed_usd=None, source="openai")


def test_counters_are_the_registry_summed_over_labels() -> None:
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    metrics.observe_request(model="a", status=200, stream=False, duration=0.1, ttfb=0.05,
                            usage=usage(1000, 600), cost=Cost(usd=0.25, billed=True))
    metrics.observe_request(model="b", status=200, stream=True, duration=0.1, ttfb=0.05,
                            usage=usage(500, None), cost=Cost(usd=0.125, billed=False))
    metrics.observe_request(model="b", status=503, stream=False, duration=0.1, ttfb=None, usage=None, cost=None)
    metrics.observe_repairs(["tools_order", "arguments"], 700, "a")
    metrics.observe_break("system_changed")
    metrics.observe_break("system_changed")
    metrics.observe_break("content_changed")

    reading = read_counters(registry)
    t = reading.totals
    assert (t.requests, t.requests_failed) == (3, 1)
    assert (t.prompt_tokens, t.cached_tokens, t.cache_known_tokens) == (1500, 600, 1000)
    assert t.completion_tokens == 20
    assert (t.rescued_tokens, t.repairs, t.breaks) == (700, 2, 3)
    assert (t.cost_billed_usd, t.cost_estimated_usd) == (0.25, 0.125)
    assert t.hit_pct == pytest.approx(60.0)
    assert reading.breaks_by_reason == {"system_changed": 2, "content_changed": 1}
    assert registry.get_sample_value("kvwarm_cached_prompt_tokens_total", {"model": "a"}) == t.cached_tokens


def test_cache_writes_and_savings_are_read_back() -> None:
    """The page's "saved by the cache" numbers are the savings counters summed over ``by`` (the
    repairs' share apart) less the write premium; the written tokens summed over ``ttl``."""
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    price = Price(input=3.0, cached_input=0.3, cache_write=3.75, cache_write_1h=6.0, output=15.0)
    first = Usage(prompt_tokens=4100, completion_tokens=10, cached_tokens=0, cache_write_tokens=4000,
                  cache_write_1h_tokens=4000)
    second = Usage(prompt_tokens=4300, completion_tokens=10, cached_tokens=4000, cache_write_tokens=200,
                   cache_write_5m_tokens=200)
    metrics.observe_request(model="a", status=200, stream=False, duration=0.1, ttfb=0.05, usage=first,
                            cost=cost_of(first, price))
    loss = read_counters(registry).totals
    assert loss.cache_write_tokens == 4000
    assert loss.net_savings_usd == pytest.approx(-4000 * 3e-6)  # written for an hour, not read yet
    metrics.observe_request(model="b", status=200, stream=True, duration=0.1, ttfb=0.05, usage=second,
                            cost=cost_of(second, price), rescued_tokens=1000)
    t = read_counters(registry).totals
    assert (t.cached_tokens, t.cache_write_tokens) == (4000, 4200)
    assert t.savings_usd == pytest.approx(4000 * 2.7e-6)
    assert t.repair_savings_usd == pytest.approx(1000 * 2.7e-6)
    assert t.write_premium_usd == pytest.approx(4000 * 3e-6 + 200 * 0.75e-6)
    assert t.net_savings_usd == pytest.approx(4000 * 2.7e-6 - 4000 * 3e-6 - 200 * 0.75e-6)
    view = build_view(_overview(t))["text"]
    assert view["cache_rw"] == "4,000 read · 4,200 written to the cache"
    assert view["saved_today"] == fmt_usd(t.net_savings_usd) == "-$0.0014"  # -1350 per million
    assert view["saved_tone"] == "bad"
    assert view["saved_split"] == f"reads saved {fmt_usd(t.savings_usd)} · writes cost {fmt_usd(t.write_premium_usd)} extra"
    assert view["saved_repair"] == "$0.0027 of it by repairs"


def _overview(current: Totals) -> dict[str, Any]:
    """The operator's overview of a process that counted ``current`` since midnight."""
    history = History(started=T0)
    return build_overview(
        viewer=Viewer(tenant=None, why="loopback"), reading=Reading(totals=current, breaks_by_reason={}),
        history=history, activity=Activity(), sessions=[], previews={}, upstreams=[{"url": "http://u", "state": "healthy"}],
        routing="prefix", now=T0 + 30, pid=1, version="x",
    )


def test_no_known_cache_is_no_hit_ratio() -> None:
    assert ZERO.hit_pct is None
    assert Totals(prompt_tokens=100).hit_pct is None


# -- history ----------------------------------------------------------------------------------


def totals(requests: float, cached: float = 0.0, known: float = 0.0, cost: float = 0.0) -> Totals:
    return Totals(requests=requests, cached_tokens=cached, cache_known_tokens=known, cost_estimated_usd=cost)


def test_minutes_are_differences_of_snapshots() -> None:
    h = History(started=T0)
    h.record(ZERO, T0 + 1)
    h.record(totals(2, 50, 100), T0 + 30)
    h.record(totals(3, 150, 200), T0 + 59)  # same minute: replaces
    h.record(totals(5, 150, 300), T0 + 180 + 5)  # minutes 1 and 2 unsampled
    minutes = h.minutes(T0 + 180 + 10, 4)
    assert [m.requests for m in minutes] == [3, 0, 0, 2]
    assert [m.hit_pct for m in minutes] == [75.0, None, None, 0.0]
    live = totals(9, 250, 400)
    assert h.minutes(T0 + 180 + 20, 4, live)[-1] == totals(6, 100, 200)  # the live reading ends minute 3
    assert h.since(T0 + 120, live) == totals(6, 100, 200)
    assert h.since(T0, live) == live  # before the first snapshot the counters were zero


def test_the_ring_is_bounded_and_forgets_the_oldest() -> None:
    h = History(started=T0, capacity_minutes=10)
    for i in range(50):
        h.record(totals(i), T0 + 60 * i)
    assert len(h) == h.capacity == 12
    assert h.at(0) == totals(38)  # older than the ring: its oldest entry, not zero
    assert sum(m.requests for m in h.minutes(T0 + 60 * 49, 10)) == 10


def test_a_clock_stepping_back_does_not_reorder_the_ring() -> None:
    h = History(started=T0)
    h.record(totals(1), T0 + 120)
    h.record(totals(2), T0 + 60)
    assert h.at(int(T0 // 60) + 2) == totals(2)
    assert len(h) == 1


def test_today_starts_at_local_midnight() -> None:
    now = datetime(2026, 11, 23, 14, 30).timestamp()
    assert datetime.fromtimestamp(local_midnight(now)) == datetime(2026, 11, 23)
    h = History(started=now - 86_400)
    h.record(totals(10, cost=1.0), local_midnight(now) - 30)
    h.record(totals(12, cost=1.5), now - 60)
    assert h.since(local_midnight(now), totals(15, cost=2.0)) == totals(5, cost=1.0)


@pytest.mark.parametrize(("uptime", "window"), [(0, 60), (3599, 60), (3600, 180), (5 * 3600, 360), (30 * 3600, 1440)])
def test_the_chart_window_grows_with_uptime(uptime: float, window: int) -> None:
    assert window_minutes(uptime) == window


# -- activity ---------------------------------------------------------------------------------

TS = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z"
SHAPE = "dddd-dd-ddTdd:dd:dd.dddZ"


def test_examples_are_per_tenant_deduplicated_and_newest_first() -> None:
    a = Activity()
    a.note_break(b"alice", "system_changed", "messages[0]", SHAPE, TS, 1.0)
    a.note_break(b"alice", "system_changed", "messages[0]", SHAPE, TS, 2.0)
    a.note_break(b"alice", "content_changed", "messages[3]", "dd", r"\d{2}", 3.0, role="tool")
    a.note_break(b"bob", "tools_changed", "tools", "ddd", r"\d{3}", 4.0)
    mine = a.examples(b"alice")
    assert [(e.reason, e.count, e.last_seen) for e in mine] == [("content_changed", 1, 3.0), ("system_changed", 2, 2.0)]
    assert mine[1].pin_line == f"system = ['{TS}']"  # the reason implies the role
    assert mine[0].pin_line == r"tool = ['\d{2}']"
    assert a.examples(b"bob")[0].pin_line == ""  # tools cannot be pinned
    assert {e.tenant for e in a.examples()} == {b"alice", b"bob"}
    assert a.counts(b"alice") == {"system_changed": 2, "content_changed": 1}
    assert a.examples(b"carol") == [] and a.counts(b"carol") == {}


def test_activity_stays_bounded() -> None:
    a = Activity(per_reason=3, max_tenants=4, max_reasons=2)
    for t in range(10):
        for i in range(20):
            a.note_break(bytes([t]), "content_changed", f"messages[{i}]", "d" * (i + 1), r"\d", float(i))
        a.note_break(bytes([t]), "system_changed", "messages[0]", "d", r"\d", 30.0)
        a.note_break(bytes([t]), "tools_changed", "tools", "d", r"\d", 31.0)  # a third reason: counted nowhere
    assert {e.tenant for e in a.examples(limit=1000)} == {bytes([t]) for t in range(6, 10)}
    kept = a.examples(bytes([9]), limit=1000)
    assert [e.where for e in kept if e.reason == "content_changed"] == ["messages[19]", "messages[18]", "messages[17]"]
    assert a.counts(bytes([9])) == {"content_changed": 20, "system_changed": 1}
    a.note_break(b"x", "content_changed", "messages[1]", "a" * 10_000, "x" * 10_000, 0.0, role="user")
    long = a.examples(b"x")[0]
    assert len(long.shape) <= 96 and long.hint == "" and long.pin_line == ""


@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_toml_strings_read_back_exactly(text: str) -> None:
    assert tomllib.loads(f"k = {toml_string(text)}") == {"k": text}


@pytest.mark.parametrize(
    ("role", "hint"),
    [("system", TS), ("user", r"[0-9A-Za-z]{8}"), ("us'er", "'\n"), ("tool", r"it's \d+"), ("developer", '"\\d"')],
)
def test_a_pin_line_is_config_kvwarm_accepts(role: str, hint: str) -> None:
    line = pin_line(role, hint)
    table = tomllib.loads(line)
    assert table == {role: [hint]}
    policy = Policy.build(repair=True, collapse_duplicates=False, pin_patterns=table)
    assert policy.pins(role)[0].pattern == hint


@pytest.mark.parametrize(("role", "hint"), [("", TS), ("system", ""), ("system", "a*"), ("system", "(")])
def test_no_pin_line_kvwarm_would_refuse(role: str, hint: str) -> None:
    assert pin_line(role, hint) == ""


# -- view -------------------------------------------------------------------------------------


def test_formats() -> None:
    assert (fmt_count(1234567.0), fmt_count(None)) == ("1,234,567", "—")
    assert (fmt_pct(62.449), fmt_pct(None)) == ("62.4 %", "—")
    assert (fmt_usd(0.16104), fmt_usd(1234.5)) == ("$0.1610", "$1,234.50")
    assert (fmt_usd(-0.0123), fmt_usd(-1234.5), fmt_usd(-0.00001)) == ("-$0.0123", "-$1,234.50", "$0.0000")
    assert (fmt_age(100, 102), fmt_age(100, 400), fmt_age(0, 7300)) == ("just now", "5 min ago", "2 h 1 min ago")


def test_the_chart_breaks_its_line_where_nothing_was_known() -> None:
    buckets = [{"hit_pct": 50.0, "requests": 2}, {"hit_pct": 100.0, "requests": 4}, {"hit_pct": None, "requests": 0},
               {"hit_pct": 0.0, "requests": 1}]
    paths = chart_paths(buckets)
    assert paths["chart_line"] == "M75 50L225 0M525 100"
    assert paths["chart_dots"] == "M525 100h0"  # a lone point is drawn as a dot
    assert len(re.findall("M", paths["chart_bars"])) == 3
    assert chart_paths([]) == {"chart_line": "", "chart_dots": "", "chart_bars": ""}


def test_the_upstream_is_shown_without_credentials() -> None:
    assert display_url("https://user:secret@api.example.com/v1?api-key=k#x") == "https://api.example.com/v1"


# -- the session listing's cost -----------------------------------------------------------------


class CountingStore(MemoryStore):
    """A real memory store that counts its listings."""

    listings = 0

    def sessions(self, tenant: bytes | None = None) -> list[SessionInfo]:
        self.listings += 1
        return super().sessions(tenant)


async def test_a_slow_session_listing_is_reused_for_twenty_times_its_cost() -> None:
    counting = CountingStore(ttl_seconds=3600, max_bytes=1 << 20)
    store = LocalStore(counting)
    ticks = iter([0.0, 1.0, 10.0, 19.9, 21.0, 21.001, 21.002, 21.003, 21.1, 21.2])  # each read: start[, end]
    reads = SessionReads(clock=lambda: next(ticks))
    await reads.read(store, None)  # t=0, took 1 s
    await reads.read(store, None)  # t=10: reused
    await reads.read(store, None)  # t=19.9: reused
    assert counting.listings == 1
    await reads.read(store, None)  # t=21: read again, took 1 ms
    await reads.read(store, b"tenant")  # another viewer: its own read
    await reads.read(store, None)  # t=21.1: 0.1 s later, more than 20 ms: read again
    assert counting.listings == 4
