"""Metrics and the log line are written after the response, in batches, and stay exact.

* a read of the registry -- ``get_sample_value``, the ``/metrics`` text, the live page's counters
  -- right after a request is reported (before the event loop ran its queue) sees it;
* a batch adds up to exactly what observing one by one gives, histogram buckets included;
* with several workers (prometheus-client's multiprocess files) the batch is in the files at
  the end of the loop iteration, for another worker's scrape;
* end to end, through kvwarm with the official openai SDK against the reference upstream: after
  every response, ``/metrics`` and ``/kvwarm/api/overview`` count it and its tokens, and the log
  has its line.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.core.match import tenant_root
from proxy.core.plan import plan_turn
from proxy.core.policy import Policy
from proxy.core.pricing import Cost
from proxy.core.usage import Usage
from proxy.metrics import LATENCY_BUCKETS, ProxyMetrics
from proxy.request.report import Answer, Reporter
from proxy.store.memory.store import MemoryStore
from proxy.web.counters import read_counters
from tests.conftest import ProxyFactory

REPO = Path(__file__).resolve().parents[2]
USAGE = Usage(prompt_tokens=1200, completion_tokens=30, cached_tokens=1024, cache_write_tokens=None,
              reasoning_tokens=None, billed_usd=None, source="openai")
LABELS = {"model": "gpt-4o-mini", "status": "2xx", "stream": "false"}


def a_plan() -> Any:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    return plan_turn(body, tenant_root(b"s" * 32, ""), MemoryStore(3600, 1 << 30), Policy())


async def test_a_read_right_after_a_report_sees_it() -> None:
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    reporter = Reporter(metrics)
    plan = a_plan()
    for n in range(1, 4):
        reporter.report("chat", "gpt-4o-mini", False, plan, Answer(status=200, ttfb=0.01, usage=USAGE), 0.02)
        # Queued for the end of this loop iteration: nothing has run it yet.
        assert reporter._queue, "the report is written after the response, not in the request"
        assert registry.get_sample_value("kvwarm_requests_total", LABELS) == n
        assert not reporter._queue and not metrics._batch
    reporter.report("chat", "gpt-4o-mini", False, plan, Answer(status=200, ttfb=0.01, usage=USAGE), 0.02)
    text = generate_latest(registry).decode()
    assert 'kvwarm_requests_total{model="gpt-4o-mini",status="2xx",stream="false"} 4.0' in text
    reporter.report("chat", "gpt-4o-mini", False, plan, Answer(status=200, ttfb=0.01, usage=USAGE), 0.02)
    totals = read_counters(registry).totals
    assert totals.requests == 5
    assert totals.prompt_tokens == 5 * 1200 and totals.cached_tokens == 5 * 1024
    # And the queue empties by itself at the end of the iteration, with nobody reading.
    reporter.report("chat", "gpt-4o-mini", False, plan, Answer(status=200, ttfb=0.01, usage=USAGE), 0.02)
    await asyncio.sleep(0)
    assert not reporter._queue
    assert registry.get_sample_value("kvwarm_request_messages_total") == 6


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(
        st.one_of(st.sampled_from([0.0, *LATENCY_BUCKETS, math.inf, -1.0]), st.floats(min_value=-1e300, max_value=1e300)),
        max_size=40,
    )
)
def test_a_batch_adds_up_to_one_observation_at_a_time(values: list[float]) -> None:
    """The request-duration histogram fed through a batch exports exactly what ``observe`` gives.
    (Finite values stay within ±1e300: forty of them cannot overflow a float, which two of
    ±9e307 can, to -inf in one grouping and to inf + -inf = NaN in another.)"""
    batched = ProxyMetrics(CollectorRegistry())
    direct = CollectorRegistry()
    reference = Histogram("kvwarm_request_duration_seconds", "x", ("model", "stream"), buckets=LATENCY_BUCKETS, registry=direct)
    child = batched._child(batched.request_duration, "m", "false")
    one = reference.labels("m", "false")
    for i, v in enumerate(values):
        batched._pending().observe(child, v)
        one.observe(v)
        if i % 7 == 6:
            batched.flush()  # several batches, each applied onto what the earlier ones left
    batched.flush()

    def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
        out = {}
        for family in registry.collect():
            if family.name == "kvwarm_request_duration_seconds":
                for s in family.samples:
                    if not s.name.endswith("_created"):
                        out[(s.name, s.labels.get("le", ""))] = s.value
        return out

    got, want = samples(batched.registry), samples(direct)
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key[0].endswith("_sum"):
            # The same values added in another grouping: equal up to float rounding, which is
            # relative to the magnitudes added (1e308 - 1e308 + 0.005 is 0.0 or 0.005 by grouping).
            scale = sum(abs(v) for v in values if math.isfinite(v))
            slack = 1e-12 + 4 * sys.float_info.epsilon * scale * max(1, len(values))
            assert (math.isnan(value) and math.isnan(got[key])) or math.isclose(got[key], value, rel_tol=1e-9, abs_tol=slack) or got[key] == value
        else:
            assert got[key] == value, key  # counts: exact


def test_several_workers_find_the_batch_in_the_files_after_the_iteration(tmp_path: Path) -> None:
    """prometheus-client in multiprocess mode (set before it is imported: a process of its own)."""
    script = textwrap.dedent(
        """
        import asyncio
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector
        from proxy.metrics import ProxyMetrics

        def requests() -> float:
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            value = merged.get_sample_value("kvwarm_requests_total", {"model": "m", "status": "2xx", "stream": "false"})
            return value or 0.0

        async def main() -> None:
            metrics = ProxyMetrics(CollectorRegistry())
            assert metrics.multiprocess
            for n in range(1, 4):
                metrics.observe_request(model="m", status=200, stream=False, duration=0.1, ttfb=0.05, usage=None, cost=None)
                assert requests() == n - 1, "batched: not in the files within the iteration"
                await asyncio.sleep(0)
                assert requests() == n, "in the files once the iteration is over"
            print("ok")

        asyncio.run(main())
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# -- end to end ---------------------------------------------------------------------------------


def scraped(text: str) -> dict[str, float]:
    """Sample name (labels summed over) -> value, from the exposition text."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def test_every_response_is_counted_by_the_next_read(
    make_proxy: ProxyFactory, sim: TestServer, openai_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.request.pipeline")
    kvwarm = await make_proxy(sim)
    client = openai_client(kvwarm)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    prompt = completion = 0
    async with aiohttp.ClientSession() as http:
        for turn in range(6):
            messages.append({"role": "user", "content": f"Question {turn}?"})
            if turn % 2:
                stream = await client.chat.completions.create(
                    model="gpt-4o-mini", messages=messages, stream=True, stream_options={"include_usage": True}
                )
                chunks = [c async for c in stream]
                usage = chunks[-1].usage
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                response = await client.chat.completions.create(model="gpt-4o-mini", messages=messages)
                usage = response.usage
                text = response.choices[0].message.content or ""
            assert usage is not None
            prompt += usage.prompt_tokens
            completion += usage.completion_tokens
            messages.append({"role": "assistant", "content": text})

            async with http.get(kvwarm.make_url("/metrics")) as r:
                metrics = scraped(await r.text())
            assert metrics["kvwarm_requests_total"] == turn + 1
            assert metrics["kvwarm_prompt_tokens_total"] == prompt
            assert metrics["kvwarm_completion_tokens_total"] == completion
            assert metrics["kvwarm_request_duration_seconds_count"] == turn + 1
            assert metrics["kvwarm_matched_messages_total"] > 0 or turn == 0
            async with http.get(kvwarm.make_url("/kvwarm/api/overview")) as r:
                overview = await r.json()
            assert overview["totals"]["requests"] == turn + 1
            assert overview["totals"]["prompt_tokens"] == prompt
            lines = [r for r in caplog.records if r.name == "proxy.request.pipeline" and r.getMessage().startswith("chat ")]
            assert len(lines) == turn + 1
            assert f"prompt={usage.prompt_tokens} " in lines[-1].getMessage()


_request = st.fixed_dictionaries({
    "model": st.sampled_from(["m1", "m2"]),
    "status": st.sampled_from([200, 200, 502, None]),
    "stream": st.booleans(),
    "usage": st.one_of(st.none(), st.builds(
        Usage, prompt_tokens=st.one_of(st.none(), st.integers(0, 5000)),
        completion_tokens=st.one_of(st.none(), st.integers(0, 50)), cached_tokens=st.one_of(st.none(), st.integers(0, 5000)),
        cache_write_tokens=st.one_of(st.none(), st.integers(0, 9)), cache_write_1h_tokens=st.one_of(st.none(), st.integers(0, 9)),
        reasoning_tokens=st.one_of(st.none(), st.integers(0, 9)),
    )),
    "cost": st.one_of(st.none(), st.builds(
        Cost, usd=st.one_of(st.none(), st.floats(0, 1)), billed=st.booleans(),
        read_saving_usd=st.one_of(st.none(), st.floats(-1, 1)), write_premium_usd=st.one_of(st.none(), st.floats(-1, 1)),
    )),
    "rescued_tokens": st.integers(0, 5000),
})


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(_request, max_size=30))
def test_requests_summed_per_series_export_what_one_at_a_time_exports(requests: list[dict[str, Any]]) -> None:
    """The request counters are summed per series between two flushes: the same samples (zeros
    included: a series observed once at 0 is exported) as applying each request on its own."""
    summed, alone = ProxyMetrics(CollectorRegistry()), ProxyMetrics(CollectorRegistry())
    for r in requests:
        for metrics in (summed, alone):
            metrics.observe_request(duration=0.01, ttfb=0.005, **r)
        alone.flush()
    summed.flush()

    def samples(metrics: ProxyMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in metrics.registry.collect() for s in family.samples
            if not s.name.endswith("_created") and family.name != "kvwarm_build"
        }

    got, want = samples(summed), samples(alone)
    assert got.keys() == want.keys()
    for key, expected in want.items():
        assert math.isclose(got[key], expected, rel_tol=1e-9, abs_tol=1e-12), key
