"""kvwarm in front of a real engine speaking Anthropic's Messages API: llama.cpp's ``/v1/messages``.

llama-server turns a Messages request into chat messages for its template (tools in the order
sent) and reports Anthropic's usage (``input_tokens`` beside ``cache_read_input_tokens``), its
slot's KV the only cache. An agent whose tools arrive in another order every turn, as a client
iterating a map sends them, reuses through kvwarm what the same agent without drift reuses, and
so waits less for its first token than when it sends the drift straight to the engine.
Every turn streams (:func:`tests.engine.workload.messages_streaming_post`).
Skipped unless ``make engine`` has built the engine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import ProxyFactory
from tests.engine.engine import engine_available, reset_slot, run_engine
from tests.engine.workload import MESSAGES_WORKLOADS, Run, run_messages_workload

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


async def fresh_run(engine: str, name: str, via: str, make_proxy: ProxyFactory | None = None) -> Run:
    reset_slot(engine)
    url = engine
    if make_proxy is not None:
        proxy = await make_proxy(engine)
        url = str(proxy.make_url("/v1"))
    return await run_messages_workload(url, MESSAGES_WORKLOADS[name], via, TURNS)


async def test_tools_reordered_gets_its_ideal_cache_through_kvwarm(engine: str, make_proxy: ProxyFactory) -> None:
    ideal = await fresh_run(engine, "no drift", "direct")
    direct = await fresh_run(engine, "tools reordered", "direct")
    warm = await fresh_run(engine, "tools reordered", "kvwarm", make_proxy)
    assert ideal.cached > 0
    # Sent directly, only the system text above the tools is reused each turn.
    assert direct.cached < 0.6 * ideal.cached, "the drift must cost the engine its cache when sent directly"
    assert warm.cached >= 0.99 * ideal.cached
    assert warm.prefilled < direct.prefilled
    # Reused KV is prefill the engine skips: the first token comes sooner (the median of turns 2..N).
    assert warm.ttft_p50 < direct.ttft_p50
    for turn in warm.turns[1:]:
        prefix = turn.headers.get("x-kvwarm-prefix", "")
        assert "break" not in prefix and "repaired=0" not in prefix, prefix
