"""Drifting agents through kvwarm keep the upstream's cache as warm as agents that never drift.

Each safe drift class (docs/ARCHITECTURE.md, "Identity") runs as a multi-turn tool-using conversation
in both cache modes of the reference upstream. The comparison is against the
same agent without drift talking to the upstream directly: per turn, the
prompt the upstream renders from what kvwarm forwarded must be token-identical,
and the reported ``cached_tokens`` equal. The same drifting agent without
kvwarm is run too, to show each drift really costs cache where it changes tokens.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.sim.render import render_tokens
from tests.agents import SAFE_DRIFTS, Agent, no_drift
from tests.conftest import ProxyFactory, poster, received

TURNS = 6
# Drifts that render the same tokens (the provider ignores them) cost nothing even without kvwarm.
TOKEN_NEUTRAL = {"content_as_parts", "null_fields"}
# A prompt-only cache (OpenAI) is hurt by serialization that varies from turn to turn or switches
# once (a resume); a consistent re-serialization of the echoed reply costs only on engines that
# cache what they generated (vLLM mode).
VARYING = {"tools_reordered", "schema_keys_shuffled", "args_keys_reordered", "varying", "resumed"}




def rendered(sim: TestServer) -> list[list[int]]:
    out = []
    for req in received(sim):
        body = orjson.loads(req.body)
        out.append(render_tokens(body["messages"], body.get("tools")))
    return out


@pytest.mark.parametrize("mode", ["openai", "vllm"])
@pytest.mark.parametrize("drift_name", sorted(SAFE_DRIFTS))
async def test_safe_drift_is_repaired(make_sim: Any, make_proxy: ProxyFactory, mode: str, drift_name: str) -> None:
    drift = SAFE_DRIFTS[drift_name]
    clean_sim, kv_sim, raw_sim = [await make_sim(cache_mode=mode) for _ in range(3)]
    kvwarm = await make_proxy(kv_sim)

    clean = await Agent(poster(clean_sim)).run(TURNS)
    warm = await Agent(poster(kvwarm), drift=drift).run(TURNS)
    cold = await Agent(poster(raw_sim), drift=drift).run(TURNS)

    # The upstream behind kvwarm saw exactly the prompts a never-drifting client sends.
    assert rendered(kv_sim) == rendered(clean_sim)
    assert [t.cached for t in warm] == [t.cached for t in clean]
    assert sum(t.cached for t in clean) > 0
    # kvwarm said what it did.
    repaired = [int(t.response["_headers"]["x-kvwarm-prefix"].split("repaired=")[1].split(";")[0]) for t in warm]
    if drift_name not in TOKEN_NEUTRAL:
        # The client's own requests rendered differently: there was something to repair.
        assert any(
            render_tokens(w.request["messages"], w.request["tools"]) != render_tokens(c.request["messages"], c.request["tools"])
            for w, c in zip(warm, clean, strict=True)
        )
        assert sum(repaired) > 0
        if mode == "vllm" or drift_name in VARYING:
            assert sum(t.cached for t in cold) < sum(t.cached for t in clean), "this drift should cost cache without kvwarm"


@pytest.mark.parametrize("mode", ["openai", "vllm"])
async def test_no_drift_is_forwarded_byte_identical(make_sim: Any, make_proxy: ProxyFactory, mode: str) -> None:
    sim = await make_sim(cache_mode=mode)
    kvwarm = await make_proxy(sim)
    agent = Agent(poster(kvwarm), drift=no_drift)
    await agent.run(4)
    for turn, req in zip(agent.turns, received(sim), strict=True):
        assert req.body == orjson.dumps(turn.request)
        assert "repaired=0" in turn.response["_headers"]["x-kvwarm-prefix"]
    for turn in agent.turns[1:]:
        n = len(turn.request["messages"])
        assert turn.response["_headers"]["x-kvwarm-prefix"].startswith(f"matched={turn.resent}/{n};")
