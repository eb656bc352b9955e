"""A pool in the settings (TOML array, comma-separated environment, repeated flag); one URL behaves
as before; every bad routing value names its key."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from proxy.cli import build_parser, settings_from
from proxy.config import load_settings
from proxy.errors import ConfigError
from proxy.routing import DECISIONS
from tests.conftest import ProxyFactory, metric, received
from tests.routing.conftest import router_of
from tests.routing.test_cache_key import post_raw


def test_a_pool_from_toml_env_and_flags(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text('[upstream]\nbase_url = ["http://a:8000/v1", "http://b:8000/v1"]\n[routing]\npolicy = "least_inflight"\n')
    s = load_settings(f, env={})
    assert s.upstream.base_url == ("http://a:8000/v1", "http://b:8000/v1")
    assert s.routing.policy == "least_inflight"
    s = load_settings(f, env={"KVWARM_UPSTREAM_BASE_URL": "http://c/v1, http://d/v1", "KVWARM_ROUTING_MAX_LOAD_FACTOR": "1.5"})
    assert s.upstream.base_url == ("http://c/v1", "http://d/v1") and s.routing.max_load_factor == 1.5
    assert s.routing.balance_abs_threshold == 32, "the shipped default"
    s = load_settings(f, env={"KVWARM_ROUTING_BALANCE_ABS_THRESHOLD": "0"})
    assert s.routing.balance_abs_threshold == 0, "0 is bounded load alone"
    args = build_parser().parse_args(["serve", "--upstream", "http://e/v1", "--upstream", "http://f/v1", "--store", "memory"])
    assert settings_from(args, **{"upstream.base_url": args.upstream}).upstream.base_url == ("http://e/v1", "http://f/v1")
    one = build_parser().parse_args(["serve", "--upstream", "http://g/v1"])
    assert settings_from(one, **{"upstream.base_url": one.upstream}).upstream.base_url == ("http://g/v1",)
    assert load_settings(None, env={}).upstream.base_url == ("https://api.openai.com/v1",)


@pytest.mark.parametrize(
    ("toml", "key", "fragment"),
    [
        ('[routing]\npolicy = "random"\n', "routing.policy", "prefix, round_robin, least_inflight"),
        ("[routing]\nmax_load_factor = 0.9\n", "routing.max_load_factor", "at least 1.0"),
        ("[routing]\nbalance_abs_threshold = -1\n", "routing.balance_abs_threshold", "0 or more"),
        ("[routing]\nbalance_abs_threshold = 2.5\n", "routing.balance_abs_threshold", "whole number"),
        ("[routing]\neject_seconds = 0\n", "routing.eject_seconds", "positive"),
        ("[routing]\neject_errors = 0\n", "routing.eject_errors", "at least 1"),
        ('[routing]\nprompt_cache_key = "always"\n', "routing.prompt_cache_key", "session"),
        ("[routing]\nprompt_cache_key_rpm = 0\n", "routing.prompt_cache_key_rpm", "at least 1"),
        ("[routing]\naffinity_entries = 0\n", "routing.affinity_entries", "at least 1"),
        ("[routing]\nsticky = true\n", "routing.sticky", "unknown key"),
        ('[upstream]\nbase_url = ["http://a/v1", "ftp://b"]\n', "upstream.base_url", "'ftp://b'"),
        ("[upstream]\nbase_url = []\n", "upstream.base_url", "at least one URL"),
        ('[upstream]\nbase_url = ["http://a/v1", "http://a/v1/"]\n', "upstream.base_url", "twice"),
        ("[upstream]\nbase_url = [1, 2]\n", "upstream.base_url", "list of URLs"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, toml: str, key: str, fragment: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_settings(f, env={})
    assert info.value.key == key
    assert fragment in str(info.value)


async def test_one_url_is_todays_behaviour(make_proxy: ProxyFactory, sim: TestServer) -> None:
    kvwarm = await make_proxy(sim)  # a string, as before
    raw = b'{"model":"m",  "messages":[{"role":"user","content":"hello"}]}'
    for _ in range(3):
        assert await post_raw(kvwarm, "/v1/chat/completions", raw) == 200
    assert await post_raw(kvwarm, "/v1/embeddings", b'{"input":"x"}') in (200, 404)
    assert [r.body for r in received(sim)[:3]] == [raw] * 3, "the client's bytes, untouched"
    router = router_of(kvwarm)
    (only,) = router.replicas
    assert not router.pooled and only.label == f"127.0.0.1:{sim.port}"
    assert metric(kvwarm, "kvwarm_upstream_requests_total", upstream=only.label) == 4
    assert all(metric(kvwarm, "kvwarm_routing_decisions_total", kind=k) == 0 for k in DECISIONS)
    assert len(router.affinity) == 0, "no affinity is kept for one upstream"  # type: ignore[arg-type]
