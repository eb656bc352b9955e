"""The Grafana dashboard works on kvwarm's real metrics.

Grafana itself is not installable here, so the dashboard is checked where its
meaning lives: its PromQL. Without Prometheus, every metric name and label a
panel uses must be one kvwarm exports (renaming a metric breaks this test, not a
user's dashboard) and every selector must honour the ``$model`` / ``$instance``
variables. With a real Prometheus scraping a kvwarm that serves drifting
agents, every panel query must parse and return data, and the "since start"
panels must equal kvwarm's own counters.

Why the stat and bar panels are "since start" and checked exactly: the
headline hit % is ``sum(kvwarm_cached_prompt_tokens_total) /
sum(kvwarm_cache_known_prompt_tokens_total)`` on the raw counters, so once
Prometheus has scraped the last request its value *is* the counters' ratio (and
what the demo's table and ``/metrics`` say). Range forms
(``increase(...[$__range])``) are extrapolated by Prometheus and cannot see the
first sample of a series born inside the range: on a young kvwarm they drop the
first scrape's worth of traffic (often the uncached first turns) and read high.
The graphs use ``rate`` over ``$__rate_interval`` as usual and are checked for
having data; the overall hit graph also against the totals, which holds because
a warm-up request is scraped before the agents start (so ``rate`` sees all of
their traffic) and the window spans the whole run.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from tests.agents import SAFE_DRIFTS, Agent
from tests.conftest import ProxyFactory, metric
from tests.dashboard.conftest import (
    LABEL_VALUES,
    LEGEND_LABEL,
    Prometheus,
    grouping_labels,
    iter_panels,
    load_dashboard,
    panel_queries,
    selectors,
    substitute,
    variable_queries,
)
from tests.dashboard.launch import PROMETHEUS_CONFIG, ROOT, prometheus_config
from tests.demo.run import SEMANTIC, agent_system, api_key, sdk_post, timestamp_in_system

MODEL = "kvwarm-sim"
SINCE_START = "Cache hit % (since start)"
SCRAPE_WAIT = 20.0
"""Seconds to wait for Prometheus to scrape what the test expects (it scrapes every second)."""
EXTRA_LABELS = {"instance", "job"}
"""Labels Prometheus adds to every scraped series."""


# -- workload ---------------------------------------------------------------------------------------

async def drive(kvwarm: TestServer, openai_client: Any, scenarios: dict[str, Any], turns: int, pause: float = 0.0,
                faults: int = 0) -> None:
    """Agents (openai SDK) through kvwarm, concurrently; ``faults`` requests get an upstream 503."""

    async def one(name: str, drift: Any) -> None:
        agent = Agent(sdk_post(openai_client(kvwarm, api_key=api_key(name))), drift=drift, system=agent_system(name))
        for _ in range(turns):
            await agent.step()
            await asyncio.sleep(pause)

    async def fault() -> None:
        with pytest.raises(openai.InternalServerError):
            await openai_client(kvwarm, api_key="sk-faults").chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "ping"}], extra_headers={"x-sim-fault": "status=503"},
            )

    await asyncio.gather(*(one(n, d) for n, d in scenarios.items()), *(fault() for _ in range(faults)))


async def responses_turn(kvwarm: TestServer, openai_client: Any) -> None:
    """One Responses API request (openai SDK): its usage reports the cache writes (zero in the
    reference upstream's default cache mode), so the write series exist."""
    response = await openai_client(kvwarm, api_key="sk-responses").responses.create(model=MODEL, input="hi")
    assert response.usage is not None


WORKLOAD = {
    "tools_reordered": SAFE_DRIFTS["tools_reordered"],
    "args_keys_reordered": SAFE_DRIFTS["args_keys_reordered"],
    "varying": SAFE_DRIFTS["varying"],
    "resumed": SAFE_DRIFTS["resumed"],
    SEMANTIC: timestamp_in_system,
}


async def exposition(kvwarm: TestServer) -> str:
    async with aiohttp.ClientSession() as s, s.get(kvwarm.make_url("/metrics")) as r:
        assert r.status == 200
        return await r.text()


def exported(text: str) -> tuple[set[str], dict[str, set[str]]]:
    """Series names a scrape of ``text`` yields (by metric type), and the label names seen per name."""
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
                "summary": ("", "_sum", "_count"), "info": ("_info",), "unknown": ("",)}
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in suffixes[family.type])
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return names, labels


# -- without Prometheus ---------------------------------------------------------------------------

def test_dashboard_is_well_formed() -> None:
    d = load_dashboard()
    assert d["uid"] == "kvwarm" and d["schemaVersion"] >= 36 and d["id"] is None
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["multi"] and variables["model"]["includeAll"] and variables["model"]["allValue"] == ".*"
    assert variable_queries(d)["model"].startswith("label_values(kvwarm_requests_total")
    assert variable_queries(d)["instance"] == "label_values(kvwarm_build_info, instance)"
    ids = [p["id"] for p in iter_panels(d)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in iter_panels(d):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p.get("description"), f"{p['title']}: say what the panel shows"
        defaults = p["fieldConfig"]["defaults"]
        assert defaults.get("unit"), f"{p['title']}: no unit"
        assert defaults.get("thresholds", {}).get("steps"), f"{p['title']}: no thresholds"
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip(), p["title"]
    top = [p for p in d["panels"] if p["gridPos"]["y"] == 0]
    assert {p["type"] for p in top} == {"stat"}
    assert {SINCE_START, "Prompt tokens rescued (since start)", "Cost today", "Requests/s"} <= {p["title"] for p in top}
    units = {p["fieldConfig"]["defaults"]["unit"] for p in iter_panels(d) if p["type"] != "row"}
    assert {"percentunit", "currencyUSD", "s", "bytes", "short", "reqps"} <= units
    hit = next(p for p in d["panels"] if p["title"].startswith("Cache hit % over time"))
    assert "cache_known_prompt_tokens" in hit["targets"][0]["expr"] and "denominator" in hit["description"]


async def test_every_metric_in_the_dashboard_is_exported(make_sim: Any, make_proxy: ProxyFactory, openai_client: Any) -> None:
    """Metric names are compared with a fresh /metrics of a running kvwarm after one request."""
    kvwarm = await make_proxy(await make_sim())
    await openai_client(kvwarm).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    names, _ = exported(await exposition(kvwarm))
    d = load_dashboard()
    exprs = [(q.name, q.expr) for q in panel_queries(d)] + [(f"${v}", q) for v, q in variable_queries(d).items()]
    assert len(exprs) > 30
    missing = {}
    for where, expr in exprs:
        used = [s.metric for s in selectors(expr)]
        assert used, f"{where}: no kvwarm metric in {expr!r}"
        missing.update({m: where for m in used if m not in names})
    assert not missing, f"metrics kvwarm does not export: {missing}"


async def test_selectors_use_real_labels_and_the_variables(make_sim: Any, make_proxy: ProxyFactory, openai_client: Any) -> None:
    """Every label a query filters or groups on exists on its metric; every selector honours $instance,
    and $model wherever the metric has a model label; legends name labels the query keeps."""
    kvwarm = await make_proxy(await make_sim())
    # Enough traffic for every labelled metric to have a series: repairs, breaks, a 5xx.
    await drive(kvwarm, openai_client, {"tools_reordered": SAFE_DRIFTS["tools_reordered"], SEMANTIC: timestamp_in_system},
                turns=3, faults=1)
    await responses_turn(kvwarm, openai_client)
    _, labels = exported(await exposition(kvwarm))
    d = load_dashboard()
    for q in panel_queries(d):
        kept: set[str] = set(EXTRA_LABELS)
        for s in selectors(q.expr):
            assert s.metric in labels, f"{q.name}: no series of {s.metric} to check labels against"
            known = labels[s.metric] | EXTRA_LABELS
            kept |= known
            assert set(s.matchers) <= known, f"{q.name}: {s.metric} has no label(s) {set(s.matchers) - known}"
            assert s.matchers.get("instance") == ("=~", "$instance"), f"{q.name}: {s.metric} ignores $instance"
            if "model" in known:
                assert s.matchers.get("model") == ("=~", "$model"), f"{q.name}: {s.metric} ignores $model"
        grouped = grouping_labels(q.expr)
        assert grouped <= kept, f"{q.name}: groups by unknown label(s) {grouped - kept}"
        legend = set(LEGEND_LABEL.findall(q.legend))
        if grouped:
            assert legend <= grouped, f"{q.name}: legend uses {legend - grouped}, which the aggregation drops"
    for name, query in variable_queries(d).items():
        match = LABEL_VALUES.match(query)
        assert match, query
        (s,) = selectors(match.group(1))
        assert match.group(2) in labels[s.metric] | EXTRA_LABELS, f"${name}: {s.metric} has no {match.group(2)}"


# -- with a real Prometheus -----------------------------------------------------------------------

@pytest.mark.prometheus
def test_promtool_accepts_the_prometheus_configs(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no `promtool` binary on PATH: install it (Debian/Ubuntu: apt-get install prometheus)")
    generated = tmp_path / "prometheus.yml"
    generated.write_text(prometheus_config("127.0.0.1:18080", scrape_interval="1s"), encoding="utf-8")
    for config in (PROMETHEUS_CONFIG, generated):
        done = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stdout + done.stderr
    text = PROMETHEUS_CONFIG.read_text(encoding="utf-8")
    assert "job_name: kvwarm" in text and '"127.0.0.1:8080"' in text and "metrics_path: /metrics" in text
    assert "scrape_interval: 5s" in text


async def wait_for_first_scrape(prom: Prometheus) -> None:
    """Prometheus applies a new scrape config within a few seconds; traffic before that is invisible to rate()."""
    deadline = time.monotonic() + SCRAPE_WAIT
    while await prom.scalar('up{job="kvwarm"}') != 1:
        assert time.monotonic() < deadline, "prometheus never scraped kvwarm"
        await asyncio.sleep(0.2)


async def wait_until_scraped(prom: Prometheus, kvwarm: TestServer, scrapes: int) -> None:
    """Until Prometheus holds kvwarm's current counter values, in at least ``scrapes`` scrapes with data."""
    known = metric(kvwarm, "kvwarm_cache_known_prompt_tokens_total", model=MODEL)
    failed = metric(kvwarm, "kvwarm_requests_total", model=MODEL, status="5xx", stream="false")
    deadline = time.monotonic() + SCRAPE_WAIT
    while True:
        seen = await prom.scalar(f'sum(kvwarm_cache_known_prompt_tokens_total{{model="{MODEL}"}})')
        seen_failed = await prom.scalar('sum(kvwarm_requests_total{status="5xx"})')
        seen_scrapes = await prom.scalar("max(count_over_time(kvwarm_cache_known_prompt_tokens_total[5m]))")
        if seen == known and (seen_failed or 0.0) == failed and (seen_scrapes or 0) >= scrapes:
            return
        assert time.monotonic() < deadline, (
            f"prometheus has {seen}/{known} tokens, {seen_failed}/{failed} 5xx, {seen_scrapes} scrapes"
        )
        await asyncio.sleep(0.25)


@pytest.mark.prometheus
async def test_every_panel_query_returns_data_from_a_real_prometheus(
    make_prometheus: Any, make_sim: Any, make_proxy: ProxyFactory, openai_client: Any
) -> None:
    kvwarm = await make_proxy(await make_sim())
    target = f"127.0.0.1:{kvwarm.port}"
    prom = await make_prometheus(target)
    started = time.monotonic()
    await wait_for_first_scrape(prom)
    # One small request, scraped before the agents start: the model-labelled series exist from then
    # on, so rate() sees all of the agents' traffic (it cannot see a series' first sample).
    await openai_client(kvwarm, api_key="sk-warmup").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    await responses_turn(kvwarm, openai_client)
    await wait_until_scraped(prom, kvwarm, scrapes=1)

    # Drifting agents, spread over a few scrapes, and one upstream 503 for the error panels.
    await drive(kvwarm, openai_client, WORKLOAD, turns=4, pause=0.5, faults=1)
    await wait_until_scraped(prom, kvwarm, scrapes=3)

    # Grafana's $__range for a time picker covering the whole run.
    range_ = f"{math.ceil(time.monotonic() - started) + 30}s"
    d = load_dashboard()
    values: dict[str, list[dict[str, Any]]] = {}
    empty = []
    for q in panel_queries(d):
        result = await prom.query(substitute(q.expr, range_))  # asserts status "success"
        values[q.name] = result
        if not any(math.isfinite(float(r["value"][1])) for r in result):
            empty.append(f"{q.name}: {q.expr}")
    assert not empty, "panel queries without data:\n" + "\n".join(empty)

    for name, query in variable_queries(d).items():
        match = LABEL_VALUES.match(query)
        assert match
        found = await prom.api(f"label/{match.group(2)}/values", **{"match[]": substitute(match.group(1))})
        assert found, f"${name}: no values"
        assert (target if name == "instance" else MODEL) in found

    # The headline stats are kvwarm's own counters, exactly.
    cached = metric(kvwarm, "kvwarm_cached_prompt_tokens_total", model=MODEL)
    known = metric(kvwarm, "kvwarm_cache_known_prompt_tokens_total", model=MODEL)
    assert 0 < cached < known
    expected = cached / known
    (since_start,) = values[f"{SINCE_START} [A]"]
    assert float(since_start["value"][1]) == pytest.approx(expected, rel=1e-9)
    assert await prom.scalar("sum(kvwarm_cached_prompt_tokens_total) / sum(kvwarm_cache_known_prompt_tokens_total)") == pytest.approx(expected, rel=1e-9)
    (rescued,) = values["Prompt tokens rescued (since start) [A]"]
    assert float(rescued["value"][1]) == metric(kvwarm, "kvwarm_repair_rescued_tokens_total", model=MODEL) > 0
    breaks = {r["metric"]["reason"]: float(r["value"][1]) for r in values["Prefix breaks by reason (since start) [A]"]}
    assert breaks == {r: metric(kvwarm, "kvwarm_prefix_breaks_total", reason=r) for r in breaks}
    assert breaks.get("system_changed", 0) > 0, "the semantic control breaks the prefix"
    (total_breaks,) = values["Prefix breaks (since start) [A]"]
    assert float(total_breaks["value"][1]) == sum(breaks.values())
    kinds = {r["metric"]["kind"]: float(r["value"][1]) for r in values["Repairs by kind (since start) [A]"]}
    assert kinds == {k: metric(kvwarm, "kvwarm_repairs_total", kind=k) for k in kinds}
    assert {"tools_order", "arguments"} <= set(kinds)
    # The rate-based hit ratio agrees with the totals here: the window holds the whole run, and every
    # series had a sample before the agents started (the warm-up's few uncached tokens are all it misses).
    (over_time,) = values["Cache hit % over time (all selected models) [A]"]
    assert float(over_time["value"][1]) == pytest.approx(expected, abs=0.01)
    assert {r["metric"]["status"] for r in values["Errors [B]"]} == {"5xx"}
    assert {r["metric"]["source"] for r in values["Cost per hour: billed vs estimated [A]"]} == {"estimated"}
    # What the cache saved: kvwarm's own counters, exactly (the reads less the writes' premium).
    saved = {by: metric(kvwarm, "kvwarm_cache_savings_usd_total", model=MODEL, by=by) for by in ("cache", "repair")}
    premium = metric(kvwarm, "kvwarm_cache_write_premium_usd_total", model=MODEL, by="cache")
    assert saved["cache"] > 0 and saved["repair"] > 0
    (net,) = values["Saved by the cache (since start) [A]"]
    assert float(net["value"][1]) == pytest.approx(saved["cache"] + saved["repair"] - premium, rel=1e-9)
    (by_repair,) = values["Saved by repairs (since start) [A]"]
    assert float(by_repair["value"][1]) == pytest.approx(saved["repair"], rel=1e-9)
    written = {r["metric"]["ttl"]: float(r["value"][1]) for r in values["Cache writes by TTL (since start) [A]"]}
    assert written == {"unknown": metric(kvwarm, "kvwarm_cache_write_tokens_total", model=MODEL, ttl="unknown")}
    assert {r["metric"]["by"] for r in values["Saved per hour: reads by source, less the write premium [A]"]} == {"cache", "repair"}
    json.dumps(values)  # every value came back as plain JSON
