"""Parallel subagents handed one shared brief (tests/breakpoints/workloads.py:subagents), direct,
under the static marker policy and through kvwarm, on an upstream that caches only at markers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.sim.markers import ANTHROPIC
from tests.breakpoints.workloads import Ledger, subagents
from tests.conftest import ProxyFactory

SimFactory = Callable[..., Awaitable[TestServer]]
ClientFactory = Callable[..., openai.AsyncOpenAI]


@pytest.mark.timeout(60)
async def test_the_second_batch_reads_the_shared_brief_only_through_kvwarm(
    make_sim: SimFactory, make_proxy: ProxyFactory, openai_client: ClientFactory
) -> None:
    """The static policy marks the system prompt and each subagent's own last message: a later
    subagent reads the system prompt only. kvwarm saw the brief shared by the first batch and marks
    where it ends: the second batch reads it too, and pays less."""
    bare_sim, static_sim = await make_sim(cache_mode=ANTHROPIC), await make_sim(cache_mode=ANTHROPIC)
    proxy = await make_proxy(await make_sim(cache_mode=ANTHROPIC), upstream__cache_breakpoints="cache_control")
    bare, static, through = Ledger(ANTHROPIC), Ledger(ANTHROPIC), Ledger(ANTHROPIC)
    routes: list[tuple[Any, Ledger, bool]] = [(bare_sim, bare, False), (static_sim, static, True), (proxy, through, False)]
    for server, ledger, marked in routes:
        await subagents(openai_client(server), ledger, 6, static=marked)
    print("\n" + "\n".join(x.line(n) for x, n in ((bare, "subagents direct"), (static, "subagents static"), (through, "subagents kvwarm"))))
    assert sorted(through.prompts) == sorted(static.prompts) == sorted(bare.prompts)  # in the order answered
    assert sum(bare.cached) == 0
    assert sum(through.cached) > sum(static.cached) and sum(through.written) < sum(static.written)
    assert through.usd < static.usd < bare.usd
