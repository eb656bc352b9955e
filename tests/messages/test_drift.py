"""Messages API agents that drift keep the upstream's cache as warm through kvwarm as agents that never drift.

Each safe drift class of the Messages API (``tests/messages/agents.py``) runs as a multi-request
tool-using conversation on the official ``anthropic`` SDK, in the reference upstream's
``anthropic`` mode (Claude Code's ``cache_control`` markers) and ``vllm`` mode. The reference is
the same agent without drift talking to the upstream directly: the prompts the upstream renders
from what kvwarm forwarded must be token-identical to the reference's, so its cache reads are
too (at least 99.5 % of them is the bar). The same drifting agent without kvwarm shows that
each drift really costs tokens where it changes them.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestServer

from tests.conftest import ProxyFactory, received
from tests.messages.agents import PARALLEL, SAFE_DRIFTS, MessagesAgent, Turn, rendered
from tests.messages.conftest import Clients

REQUESTS = 6
"""Three user turns: each a request answered with tool use, then one carrying the results."""
MIN_RATIO = 0.995
TOKEN_NEUTRAL = {"content_as_block", "system_as_block"}
"""Drifts the upstream does not render (a string and one text block render the same)."""
REPLY_ONLY = {"whitespace_stripped"}
"""Drifts that re-serialize an echoed reply the same way every time: they cost only an engine that
caches what it generated (vLLM mode), not a prompt cache (Anthropic's)."""


def prompts(sim: TestServer) -> list[list[int]]:
    return [rendered(orjson.loads(r.body)) for r in received(sim)]


def cached(turns: list[Turn]) -> int:
    return sum(t.cached for t in turns)


def repaired(turn: Turn) -> int:
    return int(turn.prefix()["repaired"])


@pytest.mark.parametrize("mode", ["anthropic", "vllm"])
@pytest.mark.parametrize("drift_name", sorted(SAFE_DRIFTS))
async def test_safe_drift_is_repaired(
    make_sim: Any, make_proxy: ProxyFactory, clients: Clients, mode: str, drift_name: str
) -> None:
    drift = SAFE_DRIFTS[drift_name]
    options: dict[str, Any] = {
        "parallel": drift_name in PARALLEL,
        "markers": mode == "anthropic",
        # The history as the SDK's objects (re-serialized by the SDK, or by the drift) or as dicts.
        "keep": "dicts" if mode == "anthropic" else "objects",
    }
    clean_sim, kv_sim, raw_sim = [await make_sim(cache_mode=mode) for _ in range(3)]
    kvwarm = await make_proxy(kv_sim)

    clean = await MessagesAgent(clients(clean_sim), **options).run(REQUESTS)
    warm = await MessagesAgent(clients(kvwarm), drift=drift, **options).run(REQUESTS)
    cold = await MessagesAgent(clients(raw_sim), drift=drift, **options).run(REQUESTS)

    # The upstream behind kvwarm saw exactly the prompts a never-drifting client sends ...
    assert prompts(kv_sim) == prompts(clean_sim)
    # ... so it gets the reference's cache.
    assert cached(clean) > 0
    assert cached(warm) >= MIN_RATIO * cached(clean)
    assert [t.cached for t in warm] == [t.cached for t in clean]
    # Every re-sent message was recognised: nothing broke, the whole re-sent prefix matched.
    for t in warm:
        assert "break" not in t.prefix(), t.prefix()
    for t in warm[1:]:
        assert int(t.prefix()["matched"].split("/")[0]) > t.resent, (t.resent, t.prefix())

    drifted = [p != c for p, c in zip(prompts(raw_sim), prompts(clean_sim), strict=True)]
    if drift_name in TOKEN_NEUTRAL:
        assert not any(drifted)
        assert sum(map(repaired, warm)) == 0
        return
    assert any(drifted), "this drift should change the tokens without kvwarm"
    assert sum(map(repaired, warm)) > 0
    if mode == "vllm" or drift_name not in REPLY_ONLY:
        assert cached(cold) < cached(clean), "this drift should cost cache without kvwarm"
