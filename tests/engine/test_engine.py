"""kvwarm in front of a real engine: llama.cpp's llama-server with SmolLM2, its real slot KV cache.

Skipped unless ``make engine`` has built the engine (``.ci/run`` builds it).
Every run starts on a fresh slot; the numbers are the engine's own
(``timings.cache_n`` / ``prompt_n``) and the client's time to first token.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import ProxyFactory
from tests.engine.engine import engine_available, reset_slot, run_engine
from tests.engine.workload import WORKLOADS, Run, run_workload

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not engine_available(), reason="engine not built: run `make engine`"),
    pytest.mark.timeout(600),  # llama-server may take 120 s to start; prefill runs on the CPU
]
TURNS = 4


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    with run_engine() as base_url:
        yield base_url


async def fresh_run(engine: str, name: str, via: str, make_proxy: ProxyFactory | None = None, **proxy_settings: Any) -> Run:
    reset_slot(engine)
    url = engine
    if make_proxy is not None:
        proxy = await make_proxy(engine, **proxy_settings)
        url = str(proxy.make_url("/v1"))
    return await run_workload(url, WORKLOADS[name], via, TURNS)


async def test_tools_reordered_gets_its_ideal_cache_through_kvwarm(engine: str, make_proxy: ProxyFactory) -> None:
    ideal = await fresh_run(engine, "no drift", "direct")
    direct = await fresh_run(engine, "tools reordered", "direct")
    warm = await fresh_run(engine, "tools reordered", "kvwarm", make_proxy)
    assert ideal.cached > 0
    # Sent directly, only the system text above the tools is reused each turn.
    assert direct.cached < 0.6 * ideal.cached, "the drift must cost the engine its cache when sent directly"
    assert warm.cached >= 0.99 * ideal.cached
    assert warm.prefilled < direct.prefilled
    assert warm.ttft_p50 < direct.ttft_p50
    assert all("repaired=0" not in t.headers["x-kvwarm-prefix"] for t in warm.turns[1:])


async def test_timestamp_control_is_untouched_without_pinning(engine: str, make_proxy: ProxyFactory) -> None:
    run = await fresh_run(engine, "timestamp in system prompt", "kvwarm", make_proxy)
    for turn in run.turns[1:]:
        prefix = turn.headers["x-kvwarm-prefix"]
        assert "break=system_changed@0" in prefix and "repaired=0" in prefix
        assert turn.cached < 0.05 * turn.prompt_tokens, "a changed system prompt must reach the engine as sent"


async def test_timestamp_is_pinned_when_the_user_opts_in(engine: str, make_proxy: ProxyFactory) -> None:
    pinned = await fresh_run(
        engine, "timestamp in system prompt", "kvwarm pinned", make_proxy,
        repair__pin_patterns={"system": [r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"]},
    )
    for turn in pinned.turns[1:]:
        assert "break" not in turn.headers["x-kvwarm-prefix"]
        assert turn.cached > 0.8 * turn.prompt_tokens
