"""The decision to ping (proxy/keepalive/bet.py) on a tenant's own history (gaps.py). Pure."""

from __future__ import annotations

import pytest

from proxy.core.pricing import Price
from proxy.keepalive.bet import PRIOR_NEVER, Stake, Timing, best_run, stake, write_bucket
from proxy.keepalive.gaps import EDGES, MAX_WEIGHT, Gaps, TenantGaps

ANTHROPIC = Price(input=3.0, output=15.0, cached_input=0.3)
"""Claude Sonnet's list prices: a 5-minute write 1.25 x input, a read 0.1 x."""
TTL, LEAD = 300.0, 30.0
PREFIX = 40_000


def history(*pauses: float, never: int = 0) -> Gaps:
    gaps = Gaps()
    for pause in pauses:
        gaps.add(pause)
    for _ in range(never):
        gaps.add_never()
    return gaps


def first_due(max_age: float = 3600.0) -> Timing:
    """The first ping of a session under a 5-minute TTL: 30 s before its prefix expires."""
    return Timing(elapsed=TTL - LEAD, expires=TTL, interval=TTL - LEAD, ttl=TTL, max_age=max_age)


def sonnet(prefix: int = PREFIX, output: int = 1) -> Stake:
    return stake(ANTHROPIC, prefix=prefix, tail=4, output=output, bucket=write_bucket(TTL))


def test_a_tenant_whose_sessions_come_back_after_six_minutes_gets_pings() -> None:
    run, value = best_run(history(*[360.0] * 20), first_due(), sonnet())
    assert run == 1
    # Back for sure (but for the prior): the write avoided, less the ping.
    bet = sonnet()
    assert value == pytest.approx(bet.saving * 20 / (20 + PRIOR_NEVER) - bet.ping)
    assert bet.saving == pytest.approx(PREFIX * (3.75 - 0.3) * 1e-6)
    assert bet.ping == pytest.approx((PREFIX * 0.3 + 4 * 3.0 + 15.0) * 1e-6)


def test_a_tenant_whose_sessions_never_come_back_gets_none() -> None:
    assert best_run(history(never=20), first_due(), sonnet()) == (0, 0.0)


def test_no_history_no_ping() -> None:
    assert best_run(Gaps(), first_due(), sonnet()) == (0, 0.0)


def test_sessions_back_within_the_ttl_need_no_ping() -> None:
    """Pauses of a minute: a session not back after 4.5 minutes is one that ended."""
    assert best_run(history(*[60.0] * 30, never=3), first_due(), sonnet()) == (0, 0.0)


def test_a_prefix_too_small_to_repay_a_ping_gets_none() -> None:
    """1,100 cached tokens save $0.0038 if the session comes back; a ping whose output costs more
    (a reasoning model's 500 tokens) is never worth it, however sure the return."""
    bet = sonnet(prefix=1100, output=500)
    assert bet.ping > bet.saving
    assert best_run(history(*[360.0] * 50), first_due(), bet) == (0, 0.0)


def test_a_long_pause_is_bridged_by_a_run_of_pings_the_first_of_which_alone_never_pays() -> None:
    """Sessions back after 14.5 minutes: the next 5 minutes hold no return, so one ping alone is a
    loss; three in a row (at 4.5, 9 and 13.5 minutes) keep the prefix to 18.5 minutes and pay."""
    gaps = history(*[870.0] * 20)
    alone, _ = best_run(gaps, first_due(max_age=TTL - LEAD), sonnet())  # one ping allowed
    assert alone == 0
    run, value = best_run(gaps, first_due(), sonnet())
    assert run == 3 and value > 0


def test_the_chance_is_the_sessions_still_away() -> None:
    """Half the sessions come back in 6 minutes, half never: at 4.5 minutes a third of those still
    away are back in time (the prior counts as one more that never comes back)."""
    gaps = history(*[360.0] * 10, never=10)
    run, value = best_run(gaps, first_due(), sonnet())
    bet = sonnet()
    assert run == 1 and value == pytest.approx(bet.saving * 10 / 21 - bet.ping)


def test_the_longest_keepalive_bounds_the_run() -> None:
    timing = first_due(max_age=1000.0)
    assert timing.pings_left() == 3  # at 270, 540, 810 s; 1080 > 1000
    assert Timing(elapsed=1001.0, expires=1030.0, interval=270.0, ttl=TTL, max_age=1000.0).pings_left() == 0
    past = Timing(elapsed=1001.0, expires=1030.0, interval=270.0, ttl=TTL, max_age=1000.0)
    assert best_run(history(*[1100.0] * 20), past, sonnet()) == (0, 0.0)


def test_what_a_late_return_reads_anyway_is_no_saving() -> None:
    """Other sessions keep the shared tools and system prompt warm: a tenant whose late returns
    still read 5,000 tokens saves only the rest. A session barely past that shared prefix gets no
    ping; one with 15,000 tokens of its own does."""
    gaps = history(*[360.0] * 20)
    for _ in range(10):
        gaps.add_late_read(5000)
    assert gaps.read_anyway == 5000

    def bet(prefix: int) -> Stake:
        return stake(ANTHROPIC, prefix=prefix, tail=4, output=1, bucket="5m", read_anyway=gaps.read_anyway)

    assert bet(5200).saving == pytest.approx(200 * (3.75 - 0.3) * 1e-6)
    assert best_run(gaps, first_due(), bet(5200)) == (0, 0.0)
    assert best_run(gaps, first_due(), bet(20_000))[0] == 1
    assert bet(4000).saving == 0.0


def test_stake_of_an_hour_write() -> None:
    bet = stake(ANTHROPIC, prefix=10_000, tail=0, output=0, bucket=write_bucket(3600.0))
    assert bet.saving == pytest.approx(10_000 * (6.0 - 0.3) * 1e-6)
    assert bet.worst == pytest.approx(10_000 * 6.0 * 1e-6)
    assert write_bucket(1800.0) == "30m" and write_bucket(123.0) == "unknown"


# -- the histogram ---------------------------------------------------------------------------------


def test_beyond_counts_what_lasted_longer_and_never() -> None:
    gaps = history(10.0, 100.0, 360.0, 5000.0, never=2)
    assert gaps.beyond(0.0) == 6
    assert gaps.beyond(200.0) == 4
    assert gaps.beyond(EDGES[-1]) == 2
    # Inside a bin the pauses are spread evenly: half of the (345, 360] bin is beyond 352.5.
    assert gaps.beyond(352.5) == pytest.approx(3.5)


def test_a_pause_beyond_a_day_is_never_coming_back() -> None:
    gaps = history(2 * 86400.0)
    assert gaps.never == 1 and gaps.beyond(86399.0) == 1


def test_recent_history_weighs_more() -> None:
    gaps = history(*[60.0] * int(MAX_WEIGHT))
    for _ in range(int(MAX_WEIGHT)):
        gaps.add_never()
    assert gaps.observations <= MAX_WEIGHT
    # As many returns as sessions that never came back, the returns first: the later half weighs
    # three quarters (kept whole, it would weigh a half).
    assert gaps.never / gaps.beyond(0.0) == pytest.approx(0.75, abs=0.01)


def test_tenants_are_bounded_least_recently_seen_first() -> None:
    tenants = TenantGaps(limit=2)
    tenants.of(b"a").add(60.0)
    tenants.of(b"b").add(60.0)
    tenants.of(b"a")
    tenants.of(b"c")
    assert len(tenants) == 2
    assert tenants.of(b"a").observations == 1  # kept: seen more recently than b
    assert tenants.of(b"b").observations == 0  # forgotten
