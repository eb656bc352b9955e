"""A small run of the keep-alive benchmark (tests/bench/keepalive.py): on paused sessions, the
keep-alive costs less than none and less than a fixed-interval pinger, in both breakpoint modes;
it never pings the tenant whose sessions never come back, and a tight budget holds."""

from __future__ import annotations

import pytest

from tests.bench.keepalive import ONE_SHOT, Workload, compare


@pytest.mark.timeout(120)
async def test_keepalive_beats_none_and_a_fixed_pinger_within_budget() -> None:
    results = await compare(Workload(sessions=16, one_shots=4))
    for mode, by in results.items():
        kv, none, fixed, tight = by["kvwarm"], by["none"], by["fixed"], by["kvwarm, tight budget"]
        assert kv.total < none.total and kv.total < fixed.total, mode
        assert kv.pings > 0 and kv.cached_returns > 0, mode
        assert kv.pings_by_tenant.get(ONE_SHOT, 0) == 0 < fixed.pings_by_tenant[ONE_SHOT], mode
        assert 0 < tight.ping_usd <= tight.budget, mode
        assert tight.outcomes.get("budget_exhausted", 0) > 0, mode
        assert kv.outcomes.get("failed", 0) == kv.outcomes.get("missed", 0) == 0, mode
