"""Drifting agents through kvwarm with the official openai SDK, and what the page tests compare with.

The agents are the demo's (``tests.demo.run``): a baseline, safe drifts kvwarm repairs,
and the semantic control whose system prompt carries the current time (a
``system_changed`` break with a located span).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from proxy.appkeys import ACTIVITY, STORE
from proxy.core.match import tenant_root
from tests.agents import Agent, Drift, Turn
from tests.demo.run import agent_system, now_stamp, sdk_post, timestamp_in_system

BREAK = re.compile(r"^(?P<reason>\w+) at (?P<where>\S+) offset=\d+ length=\d+ shape=(?P<shape>.*) hint=(?P<hint>.*)$")
"""The ``x-kvwarm-break`` response header (see ``proxy/request/report.py``)."""


_LINE = re.compile(r"\(line (\d+)\)")


def tool_result_edited(msgs: list[dict[str, Any]], tools: list[dict[str, Any]], turn: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Semantic drift: the client re-renders its tool results, and a line number in them moves
    (a ``content_changed`` break at a tool message, with a located span)."""
    for m in msgs:
        if m.get("role") == "tool" and isinstance(m.get("content"), str):
            m["content"] = _LINE.sub(lambda g: f"(line {int(g.group(1)) + turn})", m["content"])
    return msgs, tools


@dataclass
class Run:
    key: str
    """The API key the agent used (its tenant)."""
    agent: Agent

    @property
    def turns(self) -> list[Turn]:
        return self.agent.turns


async def run_agents(
    server: TestServer,
    openai_client: Callable[..., Any],
    agents: Mapping[str, tuple[str, Drift]],
    turns: int,
) -> list[Run]:
    """``agents``: name -> (API key, drift); each runs ``turns`` turns, all concurrently.

    An agent with the ``timestamp_in_system`` drift gets the current time in its system prompt.
    """

    async def one(name: str, key: str, drift: Drift) -> Run:
        system = agent_system(name)
        if drift is timestamp_in_system and not system.startswith("Current time:"):
            system = f"Current time: {now_stamp()}\n{system}"
        agent = Agent(sdk_post(openai_client(server, api_key=key)), drift=drift, system=system)
        await agent.run(turns)
        return Run(key, agent)

    return list(await asyncio.gather(*(one(n, k, d) for n, (k, d) in agents.items())))


def break_headers(runs: list[Run]) -> list[tuple[str, dict[str, str]]]:
    """(API key, parsed ``x-kvwarm-break``) of every response that carried one."""
    out = []
    for run in runs:
        for turn in run.turns:
            header = turn.response.get("_headers", {}).get("x-kvwarm-break")
            if header:
                m = BREAK.match(header)
                assert m, f"unexpected x-kvwarm-break format: {header!r}"
                out.append((run.key, m.groupdict()))
    return out


def feed_breaks_unless_wired(server: TestServer, runs: list[Run]) -> bool:
    """Until the request path calls ``Activity.note_break`` itself, make the call it will make,
    from each response's ``x-kvwarm-break`` header. Returns True when the hook was already wired."""
    activity = server.app[ACTIVITY]
    if activity.examples():
        return True
    secret = server.app[STORE].secret()
    for key, brk in break_headers(runs):
        root = tenant_root(secret, f"Bearer {key}")
        activity.note_break(root, brk["reason"], brk["where"], brk["shape"], brk["hint"], time.time())
    return False


async def scrape(server: TestServer) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``/metrics`` of ``server``: sample name -> labels -> value."""
    async with aiohttp.ClientSession() as s, s.get(server.make_url("/metrics")) as r:
        assert r.status == 200
        text = await r.text()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def total(metrics: Mapping[str, Mapping[tuple[tuple[str, str], ...], float]], name: str, **labels: str) -> float:
    """Sum of ``name`` over the samples whose labels include ``labels``."""
    return sum(
        value for key, value in metrics.get(name, {}).items() if all((k, v) in key for k, v in labels.items())
    )


def by_label(metrics: Mapping[str, Mapping[tuple[tuple[str, str], ...], float]], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in metrics.get(name, {}).items():
        labels = dict(key)
        out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


async def get_json(server: TestServer, path: str, **headers: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(server.make_url(path), headers=headers) as r:
        return r.status, await r.json(content_type=None)


READ_PAGE = """
(() => {
  const text = {};
  for (const el of document.querySelectorAll('[data-k]')) text[el.dataset.k] = el.textContent;
  const lists = {};
  for (const box of document.querySelectorAll('[data-list]')) {
    lists[box.dataset.list] = [...box.children].map((row) => {
      const r = {};
      for (const el of row.querySelectorAll('[data-f]')) if (!el.hidden) r[el.dataset.f] = el.textContent;
      const link = row.querySelector('a[href]');
      if (link) r.href = link.getAttribute('href');
      return r;
    });
  }
  const empty = {};
  for (const el of document.querySelectorAll('[data-empty]')) empty[el.dataset.empty] = !el.hidden;
  return {text, lists, empty, scope: document.body.dataset.scope};
})()
"""
"""What the page shows: every text slot, every list row's visible fields, which lists say "empty"."""
