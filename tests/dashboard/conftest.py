"""Dashboard test helpers: the panel queries of grafana/dashboards/kvwarm.json, and a real Prometheus server.

The Prometheus fixture runs the ``prometheus`` binary found on PATH (Debian's
``prometheus`` package in CI) as a subprocess with a temporary data directory
and a free port, scraping whatever the test names every second. Tests that use
it are marked ``prometheus`` and skipped, saying why, when there is no binary.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.dashboard.launch import DASHBOARD_JSON, prometheus_config

SCRAPE_INTERVAL = "1s"

SUBSTITUTIONS = {
    "$model": ".*",
    "$instance": ".*",
    "$__rate_interval": "1m",
    "$__interval": "1s",
}
"""What Grafana would put in place of the template variables ("All" is ``.*``: the variables' allValue)."""

METRIC = re.compile(r"\b(kvwarm_[A-Za-z0-9_:]*)\s*(\{([^}]*)\})?")
MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
LABEL_VALUES = re.compile(r"^label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\)$")


def load_dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD_JSON.read_text(encoding="utf-8"))
    return data


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and the panels inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


@dataclass(frozen=True)
class Query:
    panel: str
    ref: str
    expr: str
    legend: str
    instant: bool

    @property
    def name(self) -> str:
        return f"{self.panel} [{self.ref}]"


def panel_queries(dashboard: dict[str, Any]) -> list[Query]:
    return [
        Query(p["title"], t["refId"], t["expr"], t.get("legendFormat", ""), bool(t.get("instant")))
        for p in iter_panels(dashboard)
        if p.get("type") != "row"
        for t in p.get("targets", [])
    ]


def variable_queries(dashboard: dict[str, Any]) -> dict[str, str]:
    """The ``label_values(...)`` queries of the query variables, by variable name."""
    out = {}
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out[v["name"]] = q if isinstance(q, str) else q["query"]
    return out


def substitute(expr: str, range_: str = "1h") -> str:
    """The expression as Grafana would send it: variables replaced (longest names first)."""
    values = {**SUBSTITUTIONS, "$__range": range_}
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    assert "$" not in expr, f"unsubstituted variable in {expr!r}"
    return expr


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: dict[str, tuple[str, str]]
    """label -> (operator, value)."""


def selectors(expr: str) -> list[Selector]:
    """The kvwarm metric selectors of a PromQL expression (kvwarm's names all start with ``kvwarm_``)."""
    out = []
    for m in METRIC.finditer(expr):
        body = m.group(3) or ""
        matchers = {name: (op, value) for name, op, value in MATCHER.findall(body)}
        leftover = MATCHER.sub("", body).strip()
        assert not leftover, f"cannot parse matchers {body!r} in {expr!r}"
        out.append(Selector(m.group(1), matchers))
    return out


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for group in GROUPING.findall(expr) for label in group.split(",") if label.strip()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no `prometheus` binary on PATH: install it (Debian/Ubuntu: apt-get install prometheus)")
    return binary


class Prometheus:
    """A running Prometheus server and a small client of its HTTP API."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url
        self.session = session

    async def api(self, path: str, **params: str) -> Any:
        async with self.session.get(f"{self.url}/api/v1/{path}", params=params) as r:
            body = await r.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    async def query(self, expr: str, **params: str) -> list[dict[str, Any]]:
        """An instant query's result (a vector: a list of {"metric", "value"})."""
        data = await self.api("query", query=expr, **params)
        assert data["resultType"] == "vector", f"{expr}: {data['resultType']}"
        result: list[dict[str, Any]] = data["result"]
        return result

    async def scalar(self, expr: str) -> float | None:
        """The value of a one-element instant query, None when empty."""
        result = await self.query(expr)
        return float(result[0]["value"][1]) if result else None


@pytest.fixture
async def make_prometheus(prometheus_binary: str, tmp_path: Path) -> AsyncIterator[Callable[[str], Awaitable[Prometheus]]]:
    """``await make_prometheus("127.0.0.1:PORT")``: a Prometheus scraping that kvwarm every second."""
    procs: list[asyncio.subprocess.Process] = []
    session = aiohttp.ClientSession()

    async def make(target: str) -> Prometheus:
        config = tmp_path / "prometheus.yml"
        config.write_text(prometheus_config(target, scrape_interval=SCRAPE_INTERVAL), encoding="utf-8")
        port = free_port()
        log = tmp_path / "prometheus.log"
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                prometheus_binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                stdout=out, stderr=out,
            )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            if proc.returncode is not None:
                break
            try:
                async with session.get(f"{url}/-/ready") as r:
                    if r.status == 200:
                        return Prometheus(url, session)
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        raise AssertionError(f"prometheus did not become ready:\n{log.read_text(errors='replace')[-3000:]}")

    try:
        yield make
    finally:
        await session.close()
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
