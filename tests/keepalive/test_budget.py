"""The keep-alive budget (proxy/keepalive/budget.py): USD per rolling day, never exceeded. Pure."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.keepalive.budget import DAY, SLOT_SECONDS, Budget


def test_a_reservation_that_does_not_fit_is_refused_and_holds_nothing() -> None:
    budget = Budget(1.0)
    assert budget.reserve(0.0, 0.6)
    assert not budget.reserve(10.0, 0.6)
    assert budget.spent(10.0) == 0.6
    budget.settle(0.0, 0.6, 0.1)  # the ping read its prefix: a tenth of its worst case
    assert budget.room(20.0) == 0.9
    assert budget.reserve(20.0, 0.6)


def test_spend_leaves_the_window_after_a_day() -> None:
    budget = Budget(1.0)
    assert budget.reserve(100.0, 1.0)
    assert not budget.reserve(DAY, 0.5)  # its slot still overlaps the last 24 hours
    assert budget.reserve(100.0 + DAY + SLOT_SECONDS, 0.5)


def test_a_late_settlement_of_a_forgotten_slot_changes_nothing() -> None:
    budget = Budget(1.0)
    budget.reserve(0.0, 0.5)
    budget.reserve(2 * DAY, 0.5)
    budget.settle(0.0, 0.5, 0.0)
    assert budget.spent(2 * DAY) == 0.5


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=2**32), st.floats(min_value=0.01, max_value=5.0))
def test_no_24_hours_ever_cost_more_than_the_budget(seed: int, usd_per_day: float) -> None:
    """Pings at random times over three days, each reserving a worst case and settling to less
    (or, broken after sending, to all of it): the cost of every 24-hour window stays within."""
    rng = random.Random(seed)
    budget = Budget(usd_per_day)
    paid: list[tuple[float, float]] = []
    now = 0.0
    while now < 3 * DAY:
        now += rng.expovariate(1 / 120.0)
        worst = rng.uniform(0.0, usd_per_day / 4)
        if budget.reserve(now, worst):
            cost = worst if rng.random() < 0.1 else worst * rng.uniform(0.0, 0.3)
            budget.settle(now, worst, cost)
            paid.append((now, cost))
    assert paid
    for start, _ in paid:
        window = sum(cost for at, cost in paid if start <= at < start + DAY)
        assert window <= usd_per_day + 1e-9
