"""The schedule of watched sessions (proxy/keepalive/schedule.py): by key, and by due time with
stale heap entries skipped, never returned."""

from __future__ import annotations

from typing import Any

from proxy.keepalive.schedule import Schedule
from proxy.keepalive.watch import Watch


def watch(key: bytes, due: float) -> Watch:
    replica: Any = None  # the schedule never looks at the replica
    return Watch(
        key=key, root=b"r", model="m", dialect="openai", api="chat", path="/v1/chat/completions", query="",
        replica=replica, raw=b"{}", headers=(), turn_at=0.0, ttl=300.0, prefix=1024, tail=10, output=1,
        due=due, horizon=due + 600.0,
    )


def test_watches_fall_due_in_time_order() -> None:
    schedule = Schedule()
    late, early, middle = watch(b"a", 30.0), watch(b"b", 10.0), watch(b"c", 20.0)
    for w in (late, early, middle):
        schedule.add(w)
    assert schedule.next_due() == 10.0
    assert schedule.take_due(25.0) == [early, middle]
    assert schedule.next_due() == 30.0
    assert len(schedule) == 3  # taken off the heap, still watched


def test_a_watch_due_again_is_returned_once_at_its_new_time() -> None:
    schedule = Schedule()
    w = watch(b"a", 10.0)
    schedule.add(w)
    w.due = 50.0
    schedule.push(w)  # its entry at 10 goes stale
    assert schedule.next_due() == 50.0
    assert schedule.take_due(20.0) == []
    assert schedule.take_due(60.0) == [w]


def test_a_watch_no_longer_watched_never_falls_due() -> None:
    schedule = Schedule()
    gone, kept = watch(b"a", 10.0), watch(b"b", 20.0)
    schedule.add(gone)
    schedule.add(kept)
    assert schedule.pop(b"a") is gone  # the session came back
    assert schedule.take_due(100.0) == [kept]
    replaced = watch(b"b", 40.0)
    schedule.add(replaced)  # a new turn of the session, under the same key
    assert schedule.next_due() == 40.0
    assert schedule.take_due(100.0) == [replaced]


def test_the_heap_stays_bounded_by_the_watches() -> None:
    schedule = Schedule()
    w = watch(b"a", 0.0)
    schedule.add(w)
    for due in range(1, 10_000):
        w.due = float(due)
        schedule.push(w)
    assert len(schedule._due) <= 2 * len(schedule) + 65
    assert schedule.take_due(20_000.0) == [w]


def test_the_oldest_turn_is_evicted_first_and_a_push_to_the_front_wakes_the_background() -> None:
    schedule = Schedule()
    first, second = watch(b"a", 50.0), watch(b"b", 60.0)
    schedule.add(first)
    schedule.wake.clear()
    schedule.add(second)
    assert not schedule.wake.is_set()  # not the first due: nothing to look at again
    schedule.add(watch(b"c", 5.0))
    assert schedule.wake.is_set()
    assert schedule.pop_oldest() is first
    assert [w.key for w in schedule.clear()] == [b"b", b"c"]
    assert schedule.next_due() is None
