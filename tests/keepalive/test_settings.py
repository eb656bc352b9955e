"""``[keepalive]``: off by default, documented at its defaults, every bad value named by its key;
off, kvwarm runs no keep-alive at all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.config import load_settings
from proxy.errors import ConfigError
from proxy.keepalive import KEEPALIVE
from tests.conftest import ProxyFactory

REPO = Path(__file__).resolve().parents[2]


def test_off_by_default_and_documented_at_its_defaults() -> None:
    settings = load_settings(None, env={})
    assert settings.keepalive.enabled is False
    assert load_settings(REPO / "config" / "kvwarm.toml", env={}).keepalive == settings.keepalive


def test_from_the_environment() -> None:
    env = {"KVWARM_KEEPALIVE_ENABLED": "true", "KVWARM_KEEPALIVE_BUDGET_USD_PER_DAY": "2.5"}
    keepalive = load_settings(None, env=env).keepalive
    assert keepalive.enabled and keepalive.budget_usd_per_day == 2.5


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        ({"keepalive.budget_usd_per_day": -1}, "keepalive.budget_usd_per_day", ">= 0"),
        ({"keepalive.budget_usd_per_day": float("nan")}, "keepalive.budget_usd_per_day", "finite"),
        ({"keepalive.max_session_seconds": 0}, "keepalive.max_session_seconds", "positive"),
        ({"keepalive.lead_seconds": 300}, "keepalive.lead_seconds", "less than the cache TTL (300 s)"),
        ({"keepalive.lead_seconds": 0}, "keepalive.lead_seconds", "more than 0"),
        ({"keepalive.ttl_seconds": 60, "keepalive.lead_seconds": 60}, "keepalive.lead_seconds", "(60 s)"),
        ({"keepalive.ttl_seconds": -5}, "keepalive.ttl_seconds", "0 (the provider's default)"),
        ({"keepalive.max_sessions": 0}, "keepalive.max_sessions", "at least 1"),
        ({"keepalive.enabled": "sometimes"}, "keepalive.enabled", "true or false"),
        ({"keepalive.ping_every": 270}, "keepalive.ping_every", "unknown key"),
    ],
)
def test_bad_values_name_their_key(overrides: dict[str, Any], key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(None, env={}, overrides=overrides)
    assert caught.value.key == key
    assert fragment in str(caught.value)


async def test_off_means_no_keepalive_in_the_app(make_sim: Any, make_proxy: ProxyFactory) -> None:
    kvwarm = await make_proxy(await make_sim())
    assert KEEPALIVE not in kvwarm.app
