"""``upstream.cache_breakpoints``: validated, documented at its default, and off for every host
``auto`` does not know (the client's bytes, as before)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.config import load_settings
from proxy.errors import ConfigError
from proxy.sim.markers import OPENAI_BREAKPOINTS
from tests.conftest import ProxyFactory, received
from tests.sim.conftest import long_system_prompt

REPO = Path(__file__).resolve().parents[2]


def test_the_setting_is_validated_and_named() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(None, env={}, overrides={"upstream.cache_breakpoints": "anthropic"})
    assert caught.value.key == "upstream.cache_breakpoints"
    assert "auto, openai, cache_control, off" in str(caught.value)
    env = {"KVWARM_UPSTREAM_CACHE_BREAKPOINTS": "cache_control"}
    assert load_settings(None, env=env).upstream.cache_breakpoints == "cache_control"


def test_the_default_is_auto_and_documented() -> None:
    assert load_settings(None, env={}).upstream.cache_breakpoints == "auto"
    assert load_settings(REPO / "config" / "kvwarm.toml", env={}).upstream.cache_breakpoints == "auto"


@pytest.mark.timeout(30)
async def test_auto_leaves_an_unknown_host_as_it_was(
    make_sim: Callable[..., Awaitable[TestServer]],
    make_proxy: ProxyFactory,
    openai_client: Callable[..., openai.AsyncOpenAI],
) -> None:
    """The reference upstream on loopback is no provider ``auto`` knows: nothing is added."""
    direct, behind = await make_sim(cache_mode=OPENAI_BREAKPOINTS), await make_sim(cache_mode=OPENAI_BREAKPOINTS)
    proxy = await make_proxy(behind)
    system = long_system_prompt(160)
    headers: list[str] = []
    for i in range(3):
        messages: list[Any] = [{"role": "system", "content": system}, {"role": "user", "content": f"Task {i}."}]
        await openai_client(direct).chat.completions.create(model="gpt-5.6", messages=messages)
        raw = await openai_client(proxy).chat.completions.with_raw_response.create(model="gpt-5.6", messages=messages)
        headers.append(raw.headers["x-kvwarm-prefix"])
    assert [r.body for r in received(behind)] == [r.body for r in received(direct)]
    assert not any("breakpoints" in h for h in headers)
