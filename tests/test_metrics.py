"""ProxyMetrics: values read back from a fresh registry, bounded labels, valid exposition."""

from __future__ import annotations

import ast
import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import proxy
from proxy import native
from proxy.core.pricing import Cost, Price, cost_of
from proxy.core.usage import Usage
from proxy.metrics import ERROR_STAGES, ProxyMetrics
from proxy.metrics.table import FAMILIES
from proxy.store.base import StoreStats


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> ProxyMetrics:
    return ProxyMetrics(registry)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def usage(
    prompt: int | None = 1000,
    completion: int | None = 50,
    cached: int | None = 800,
    write: int | None = None,
    reasoning: int | None = None,
) -> Usage:
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached, cache_write_tokens=write,
        reasoning_tokens=reasoning,
    )


def observe(metrics: ProxyMetrics, **overrides: object) -> None:
    args: dict[str, object] = {
        "model": "gpt-4o",
        "status": 200,
        "stream": True,
        "duration": 1.5,
        "ttfb": 0.3,
        "usage": usage(),
        "cost": Cost(usd=0.002, billed=False),
    }
    args.update(overrides)
    metrics.observe_request(**args)  # type: ignore[arg-type]


def test_request_usage_and_cost(metrics: ProxyMetrics, registry: CollectorRegistry) -> None:
    observe(metrics, usage=usage(1000, 50, 800, write=100, reasoning=20))
    observe(metrics, usage=usage(500, 10, 0), stream=False, cost=Cost(usd=0.01, billed=True))
    m = {"model": "gpt-4o"}
    assert (
        value(registry, "kvwarm_requests_total", model="gpt-4o", status="2xx", stream="true") == 1
    )
    assert (
        value(registry, "kvwarm_requests_total", model="gpt-4o", status="2xx", stream="false") == 1
    )
    assert value(registry, "kvwarm_prompt_tokens_total", **m) == 1500
    assert value(registry, "kvwarm_cached_prompt_tokens_total", **m) == 800
    assert value(registry, "kvwarm_cache_known_prompt_tokens_total", **m) == 1500
    assert value(registry, "kvwarm_completion_tokens_total", **m) == 60
    assert value(registry, "kvwarm_reasoning_tokens_total", **m) == 20
    assert value(registry, "kvwarm_cache_write_tokens_total", ttl="unknown", **m) == 100
    assert value(
        registry, "kvwarm_cost_usd_total", model="gpt-4o", source="estimated"
    ) == pytest.approx(0.002)
    assert value(
        registry, "kvwarm_cost_usd_total", model="gpt-4o", source="billed"
    ) == pytest.approx(0.01)
    assert value(registry, "kvwarm_usage_unknown_cache_total", **m) is None
    assert value(registry, "kvwarm_usage_missing_total", **m) is None


def test_unknown_cache_stays_out_of_the_hit_ratio_denominator(
    metrics: ProxyMetrics, registry: CollectorRegistry
) -> None:
    observe(metrics, usage=usage(1000, 10, 900))
    observe(metrics, usage=usage(3000, 10, None))  # a provider that does not report caching
    m = {"model": "gpt-4o"}
    assert value(registry, "kvwarm_prompt_tokens_total", **m) == 4000
    assert value(registry, "kvwarm_cache_known_prompt_tokens_total", **m) == 1000
    assert value(registry, "kvwarm_cached_prompt_tokens_total", **m) == 900
    assert value(registry, "kvwarm_usage_unknown_cache_total", **m) == 1
    # The per-request ratio histogram saw only the known response (0.9).
    assert value(registry, "kvwarm_request_cache_hit_ratio_count", **m) == 1
    assert value(registry, "kvwarm_request_cache_hit_ratio_bucket", model="gpt-4o", le="0.8") == 0
    assert value(registry, "kvwarm_request_cache_hit_ratio_bucket", model="gpt-4o", le="0.9") == 1


def test_zero_cached_is_a_known_miss(metrics: ProxyMetrics, registry: CollectorRegistry) -> None:
    observe(metrics, usage=usage(1000, 10, 0))
    assert value(registry, "kvwarm_cache_known_prompt_tokens_total", model="gpt-4o") == 1000
    assert value(registry, "kvwarm_cached_prompt_tokens_total", model="gpt-4o") == 0
    assert value(registry, "kvwarm_request_cache_hit_ratio_bucket", model="gpt-4o", le="0.0") == 1


def test_missing_usage_counts_only_for_successful_responses(
    metrics: ProxyMetrics, registry: CollectorRegistry
) -> None:
    observe(metrics, usage=None, cost=None)
    observe(metrics, usage=None, cost=None, status=502)
    observe(metrics, usage=None, cost=None, status=None, ttfb=None)
    assert value(registry, "kvwarm_usage_missing_total", model="gpt-4o") == 1
    assert (
        value(registry, "kvwarm_requests_total", model="gpt-4o", status="5xx", stream="true") == 1
    )
    assert (
        value(registry, "kvwarm_requests_total", model="gpt-4o", status="error", stream="true") == 1
    )
    assert value(registry, "kvwarm_upstream_ttfb_seconds_count", model="gpt-4o", stream="true") == 2
    assert (
        value(registry, "kvwarm_request_duration_seconds_count", model="gpt-4o", stream="true") == 3
    )


def test_unpriced_requests(metrics: ProxyMetrics, registry: CollectorRegistry) -> None:
    observe(metrics, model="my-finetune", cost=Cost(usd=None, billed=False))
    assert value(registry, "kvwarm_unpriced_requests_total", model="my-finetune") == 1
    assert value(registry, "kvwarm_cost_usd_total", model="my-finetune", source="estimated") is None


def test_model_label_is_bounded(registry: CollectorRegistry) -> None:
    metrics = ProxyMetrics(registry, max_models=2)
    for model in ("a", "b", "c", "d", "a"):
        observe(metrics, model=model)
    requests = {"status": "2xx", "stream": "true"}
    assert value(registry, "kvwarm_requests_total", model="a", **requests) == 2
    assert value(registry, "kvwarm_requests_total", model="b", **requests) == 1
    assert value(registry, "kvwarm_requests_total", model="c", **requests) is None
    assert value(registry, "kvwarm_requests_total", model="other", **requests) == 2
    assert metrics.model_label("") == "unknown"
    assert metrics.model_label("b") == "b"
    assert metrics.model_label("x" * 500) == "other"


def test_latency_histograms_use_llm_buckets(
    metrics: ProxyMetrics, registry: CollectorRegistry
) -> None:
    observe(metrics, duration=95.0, ttfb=0.004)
    labels = {"model": "gpt-4o", "stream": "true"}
    assert value(registry, "kvwarm_upstream_ttfb_seconds_bucket", le="0.005", **labels) == 1
    assert value(registry, "kvwarm_request_duration_seconds_bucket", le="60.0", **labels) == 0
    assert value(registry, "kvwarm_request_duration_seconds_bucket", le="120.0", **labels) == 1
    assert value(registry, "kvwarm_request_duration_seconds_sum", **labels) == 95.0


def test_repairs_breaks_and_matching(metrics: ProxyMetrics, registry: CollectorRegistry) -> None:
    metrics.observe_repairs(["arguments_json", "tools_order", "arguments_json"], 12_000, "gpt-4o")
    metrics.observe_repairs([], 0, "gpt-4o")
    metrics.observe_break("content_changed")
    metrics.observe_break("content_changed")
    metrics.observe_match(7, 9)
    metrics.observe_match(0, 3)
    assert value(registry, "kvwarm_repairs_total", kind="arguments_json") == 2
    assert value(registry, "kvwarm_repairs_total", kind="tools_order") == 1
    assert value(registry, "kvwarm_repair_rescued_tokens_total", model="gpt-4o") == 12_000
    assert value(registry, "kvwarm_prefix_breaks_total", reason="content_changed") == 2
    assert value(registry, "kvwarm_matched_messages_total") == 7
    assert value(registry, "kvwarm_request_messages_total") == 12


def test_kind_and_reason_vocabularies_are_capped(
    metrics: ProxyMetrics, registry: CollectorRegistry
) -> None:
    for i in range(60):
        metrics.observe_break(f"reason_{i}")
    assert value(registry, "kvwarm_prefix_breaks_total", reason="reason_49") == 1
    assert value(registry, "kvwarm_prefix_breaks_total", reason="reason_50") is None
    assert value(registry, "kvwarm_prefix_breaks_total", reason="other") == 10


def test_errors_by_stage(metrics: ProxyMetrics, registry: CollectorRegistry) -> None:
    for stage in ERROR_STAGES:
        assert value(registry, "kvwarm_errors_total", stage=stage) == 0  # present from the start
    metrics.error("repair")
    metrics.error("repair")
    metrics.error("something-new")
    assert value(registry, "kvwarm_errors_total", stage="repair") == 2
    assert value(registry, "kvwarm_errors_total", stage="other") == 1


def test_inflight(metrics: ProxyMetrics, registry: CollectorRegistry) -> None:
    with metrics.inflight():
        with metrics.inflight():
            assert value(registry, "kvwarm_inflight_requests") == 2
    assert value(registry, "kvwarm_inflight_requests") == 0
    with pytest.raises(RuntimeError), metrics.inflight():
        raise RuntimeError("boom")
    assert value(registry, "kvwarm_inflight_requests") == 0


def test_store_gauges(metrics: ProxyMetrics, registry: CollectorRegistry) -> None:
    metrics.set_store(StoreStats(nodes=10, bytes=4096, blobs=3, sessions=2, corrupt=1, evicted=0))
    assert value(registry, "kvwarm_store_nodes") == 10
    assert value(registry, "kvwarm_store_bytes") == 4096
    assert value(registry, "kvwarm_store_sessions") == 2
    assert value(registry, "kvwarm_store_corrupt_entries") == 1
    current = {"stats": StoreStats(nodes=1, bytes=2, blobs=0, sessions=3, corrupt=0, evicted=0)}
    metrics.track_store(lambda: current["stats"])
    assert value(registry, "kvwarm_store_nodes") == 1
    current["stats"] = StoreStats(nodes=5, bytes=2, blobs=0, sessions=3, corrupt=4, evicted=0)
    assert value(registry, "kvwarm_store_nodes") == 5  # read at scrape time
    assert value(registry, "kvwarm_store_corrupt_entries") == 4


def test_build_info(registry: CollectorRegistry, metrics: ProxyMetrics) -> None:
    assert value(registry, "kvwarm_build_info", version=proxy.__version__, native=proxy.native.native_label()) == 1
    assert proxy.native.native_label() == ("compiled" if proxy.native.state() == "compiled" else "pure")


def test_two_instances_do_not_share_state() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    observe(ProxyMetrics(first))
    ProxyMetrics(second)
    labels = {"model": "gpt-4o", "status": "2xx", "stream": "true"}
    assert value(first, "kvwarm_requests_total", **labels) == 1
    assert value(second, "kvwarm_requests_total", **labels) is None


EXPECTED_FAMILIES = {
    "kvwarm_requests": "counter",
    "kvwarm_prompt_tokens": "counter",
    "kvwarm_cached_prompt_tokens": "counter",
    "kvwarm_cache_write_tokens": "counter",
    "kvwarm_completion_tokens": "counter",
    "kvwarm_reasoning_tokens": "counter",
    "kvwarm_cache_known_prompt_tokens": "counter",
    "kvwarm_usage_unknown_cache": "counter",
    "kvwarm_usage_missing": "counter",
    "kvwarm_cost_usd": "counter",
    "kvwarm_unpriced_requests": "counter",
    "kvwarm_cache_savings_usd": "counter",
    "kvwarm_cache_write_premium_usd": "counter",
    "kvwarm_request_cache_hit_ratio": "histogram",
    "kvwarm_repair_rescued_tokens": "counter",
    "kvwarm_repairs": "counter",
    "kvwarm_repairs_refused": "counter",
    "kvwarm_breakpoints": "counter",
    "kvwarm_breakpoints_refused": "counter",
    "kvwarm_upstream_requests": "counter",
    "kvwarm_upstream_inflight": "gauge",
    "kvwarm_upstream_ejections": "counter",
    "kvwarm_routing_decisions": "counter",
    "kvwarm_prefix_breaks": "counter",
    "kvwarm_provider_cache_diagnoses": "counter",
    "kvwarm_provider_cache_misses": "counter",
    "kvwarm_matched_messages": "counter",
    "kvwarm_request_messages": "counter",
    "kvwarm_keepalive_requests": "counter",
    "kvwarm_keepalive_tokens": "counter",
    "kvwarm_keepalive_saved_usd": "counter",
    "kvwarm_keepalive_lost_usd": "counter",
    "kvwarm_request_duration_seconds": "histogram",
    "kvwarm_upstream_ttfb_seconds": "histogram",
    "kvwarm_inflight_requests": "gauge",
    "kvwarm_store_nodes": "gauge",
    "kvwarm_store_bytes": "gauge",
    "kvwarm_store_sessions": "gauge",
    "kvwarm_store_corrupt_entries": "gauge",
    "kvwarm_errors": "counter",
    "kvwarm_build_info": "gauge",
}


def populated() -> bytes:
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    observe(metrics, usage=usage(1000, 50, 800, write=5, reasoning=3),
            cost=Cost(usd=0.002, billed=False, read_saving_usd=0.001, write_premium_usd=0.0001,
                      saving_per_cached_token=1e-6), rescued_tokens=300)
    observe(metrics, cost=Cost(usd=None, billed=False), usage=usage(cached=None))
    observe(metrics, usage=None, cost=None)
    metrics.observe_repairs(["arguments_json"], 10, "gpt-4o")
    metrics.observe_break("content_changed")
    metrics.observe_match(1, 2)
    metrics.set_store(StoreStats(nodes=1, bytes=1, blobs=1, sessions=1, corrupt=0, evicted=0))
    return generate_latest(registry)


def test_exposition_names_types_and_suffixes() -> None:
    # The 0.0.4 text format shows each counter's `_created` sample as a gauge family of its own.
    families = {
        f.name: f
        for f in text_string_to_metric_families(populated().decode())
        if not f.name.endswith("_created")
    }
    assert {name: f.type for name, f in families.items()} == EXPECTED_FAMILIES
    for family in families.values():
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name in (family.name + "_total", family.name + "_created"), (
                    sample.name
                )


def test_every_row_of_the_table_is_a_typed_attribute(metrics: ProxyMetrics) -> None:
    """``Families`` declares one typed attribute per row of ``FAMILIES`` (compiled code reads
    them natively) and ``__init__`` sets them from the rows. A row without its declaration, or
    one of another kind, fails only compiled; a declaration without its row fails only when the
    attribute is first read: both are caught here, compiled or not."""
    tree = ast.parse(native.source("proxy.metrics.families").read_text(encoding="utf-8"))
    (families,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Families")
    declared = {
        n.target.id: ast.unparse(n.annotation)
        for n in families.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
    assert declared == {family.attr: kinds[family.kind].__name__ for family in FAMILIES}
    for family in FAMILIES:
        metric = getattr(metrics, family.attr)
        assert isinstance(metric, kinds[family.kind])
        assert metric.describe()[0].documentation == family.help


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_check_metrics_passes() -> None:
    result = subprocess.run(
        ["promtool", "check", "metrics"],
        input=populated(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_many_requests_between_reads_are_counted_exactly_within_bounded_lists(
    metrics: ProxyMetrics, registry: CollectorRegistry
) -> None:
    """Observations wait for a read of the registry in lists per series; past a bound a list
    goes to the histogram buckets at once. However many requests came between two reads, the
    read sees each of them once, and no list ever holds more than the bound."""
    from proxy.metrics import LISTED

    n = 3 * LISTED + 7
    durations = [0.001 * (i % 97) for i in range(n)]
    for i, d in enumerate(durations):
        observe(metrics, duration=d, ttfb=d / 2, usage=usage(100, 5, i % 101), stream=False)
        longest = max((len(v) for s in metrics._raw_series.values() for v in s.values.values()), default=0)
        assert longest < LISTED, (i, [(k, len(v)) for s in metrics._raw_series.values() for k, v in s.values.items()])
    labels = {"model": "gpt-4o", "stream": "false"}
    assert value(registry, "kvwarm_request_duration_seconds_count", **labels) == n
    assert value(registry, "kvwarm_request_duration_seconds_sum", **labels) == pytest.approx(sum(durations))
    below = sum(1 for d in durations if d <= 0.05)
    assert value(registry, "kvwarm_request_duration_seconds_bucket", le="0.05", **labels) == below
    assert value(registry, "kvwarm_upstream_ttfb_seconds_count", **labels) == n
    ratios = [min(i % 101, 100) / 100 for i in range(n)]
    assert value(registry, "kvwarm_request_cache_hit_ratio_count", model="gpt-4o") == n
    assert value(registry, "kvwarm_request_cache_hit_ratio_sum", model="gpt-4o") == pytest.approx(sum(ratios))
    assert value(registry, "kvwarm_requests_total", status="2xx", **labels) == n
    # A second read adds nothing; the next request is seen once more.
    assert value(registry, "kvwarm_request_duration_seconds_count", **labels) == n
    observe(metrics, duration=0.2, stream=False)
    assert value(registry, "kvwarm_request_duration_seconds_count", **labels) == n + 1


# -- cache writes and savings ---------------------------------------------------------------------

SONNET = Price(input=3.0, cached_input=0.3, cache_write=3.75, cache_write_1h=6.0, output=15.0)


def test_cache_writes_are_counted_by_ttl(metrics: ProxyMetrics, registry: CollectorRegistry) -> None:
    observe(metrics, usage=Usage(prompt_tokens=5000, completion_tokens=5, cached_tokens=1000, cache_write_tokens=3000,
                                 cache_write_5m_tokens=2000, cache_write_1h_tokens=1000))
    observe(metrics, usage=Usage(prompt_tokens=9000, completion_tokens=5, cached_tokens=0, cache_write_tokens=2500,
                                 cache_write_30m_tokens=2000, cache_write_12h_tokens=500))
    observe(metrics, usage=usage(1000, 5, 800, write=70))  # no split: the TTL is unknown
    observe(metrics, usage=usage(1000, 5, 800, write=None))  # no write count: nothing counted
    written = {ttl: value(registry, "kvwarm_cache_write_tokens_total", model="gpt-4o", ttl=ttl)
               for ttl in ("5m", "1h", "30m", "12h", "unknown")}
    assert written == {"5m": 2000, "1h": 1000, "30m": 2000, "12h": 500, "unknown": 70}


def test_a_reported_zero_write_count_exports_a_series(metrics: ProxyMetrics, registry: CollectorRegistry) -> None:
    observe(metrics, usage=usage(1000, 5, 800, write=0))
    assert value(registry, "kvwarm_cache_write_tokens_total", model="gpt-4o", ttl="unknown") == 0


def test_savings_split_between_the_repair_and_the_cache(metrics: ProxyMetrics, registry: CollectorRegistry) -> None:
    # 10000 read, 3000 of them rescued by a repair; 1000 written for 5 minutes, 500 for an hour.
    u = Usage(prompt_tokens=12000, completion_tokens=10, cached_tokens=10000, cache_write_tokens=1500,
              cache_write_5m_tokens=1000, cache_write_1h_tokens=500)
    observe(metrics, usage=u, cost=cost_of(u, SONNET), rescued_tokens=3000)
    m = {"model": "gpt-4o"}
    # Reads: 10000 * 2.7 = 27000 per million, 3000 * 2.7 = 8100 of it the repair's.
    assert value(registry, "kvwarm_cache_savings_usd_total", by="repair", **m) == pytest.approx(0.0081)
    assert value(registry, "kvwarm_cache_savings_usd_total", by="cache", **m) == pytest.approx(0.0189)
    # Writes: 1000 * 0.75 + 500 * 3 = 2250 per million above the input price.
    assert value(registry, "kvwarm_cache_write_premium_usd_total", by="cache", **m) == pytest.approx(0.00225)
    # More rescued than read: the repair earned at most the reads.
    observe(metrics, usage=usage(1000, 5, 400), cost=cost_of(usage(1000, 5, 400), SONNET), rescued_tokens=900)
    assert value(registry, "kvwarm_cache_savings_usd_total", by="repair", **m) == pytest.approx(0.0081 + 400 * 2.7e-6)


def test_a_net_loss_is_two_counters_that_never_go_down(metrics: ProxyMetrics, registry: CollectorRegistry) -> None:
    """Writes not repaid make the headline negative: savings minus premium, each a counter."""
    first = Usage(prompt_tokens=4100, completion_tokens=10, cached_tokens=0, cache_write_tokens=4000,
                  cache_write_1h_tokens=4000)
    observe(metrics, usage=first, cost=cost_of(first, SONNET))
    m = {"model": "gpt-4o", "by": "cache"}
    saved = value(registry, "kvwarm_cache_savings_usd_total", **m)
    premium = value(registry, "kvwarm_cache_write_premium_usd_total", **m)
    assert saved == 0 and premium == pytest.approx(0.012)
    assert saved - premium == pytest.approx(-0.012)
    # Prices below the input price (never seen, but a table may say so) move to the other counter.
    odd = Cost(usd=0.0, billed=False, read_saving_usd=-0.5, write_premium_usd=-0.25)
    observe(metrics, usage=usage(), cost=odd)
    assert value(registry, "kvwarm_cache_savings_usd_total", **m) == pytest.approx(0.25)
    assert value(registry, "kvwarm_cache_write_premium_usd_total", **m) == pytest.approx(0.512)


def test_no_savings_without_a_price_or_a_cache_count(metrics: ProxyMetrics, registry: CollectorRegistry) -> None:
    observe(metrics, usage=usage(cached=None), cost=cost_of(usage(cached=None), SONNET))
    observe(metrics, model="my-finetune", usage=usage(), cost=cost_of(usage(), None))
    for model in ("gpt-4o", "my-finetune"):
        assert value(registry, "kvwarm_cache_savings_usd_total", model=model, by="cache") is None
        assert value(registry, "kvwarm_cache_write_premium_usd_total", model=model, by="cache") is None
