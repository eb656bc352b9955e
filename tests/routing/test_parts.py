"""The pure parts of routing: health, bounded load, rendezvous hashing, the affinity table, prompt_cache_key."""

from __future__ import annotations

import orjson
import pytest

from proxy.routing.affinity import LocalAffinity
from proxy.routing.cache_key import (
    KeyShards,
    conversation_key,
    session_cache_key,
    with_prompt_cache_key,
)
from proxy.routing.health import EJECTED, HALF_OPEN, HEALTHY, Health
from proxy.routing.placement import capacity, least_loaded, overloaded, preference, spills


class Box:
    """A replica as placement sees it."""

    def __init__(self, name: str, inflight: int = 0) -> None:
        self.ident = name.encode()
        self.inflight = inflight


# -- health ---------------------------------------------------------------------------------------


def test_a_burst_of_failures_ejects_and_a_probe_brings_the_replica_back() -> None:
    h = Health(errors=3, window=10.0, eject_seconds=30.0)
    assert not h.failure(0.0) and not h.failure(4.0)
    assert h.available(5.0) and h.state(5.0) == HEALTHY
    assert h.failure(9.0)  # the third within 10 s
    assert h.state(20.0) == EJECTED and not h.available(38.9)
    assert h.state(39.0) == HALF_OPEN and h.available(39.0)
    trial = h.begin()
    assert trial and not h.available(39.5), "one probe at a time"
    h.success(trial)
    assert h.state(40.0) == HEALTHY and h.available(40.0)


def test_failures_spread_beyond_the_window_do_not_eject() -> None:
    h = Health(errors=3, window=10.0, eject_seconds=30.0)
    assert not any(h.failure(t) for t in (0.0, 6.0, 12.0, 18.0, 24.0))
    assert h.state(25.0) == HEALTHY


def test_a_refused_connection_ejects_at_once_and_a_failed_probe_ejects_again() -> None:
    h = Health(errors=3, window=10.0, eject_seconds=30.0)
    assert h.failure(0.0, refused=True)
    assert h.state(1.0) == EJECTED
    trial = h.begin()  # a last resort while ejected: its failure does not extend the pause
    assert not h.failure(2.0, trial, refused=True)
    assert h.state(30.0) == HALF_OPEN
    probe = h.begin()
    assert h.failure(31.0, probe, refused=True), "a failed probe is a new ejection"
    assert h.state(60.0) == EJECTED and h.state(61.0) == HALF_OPEN
    h.cancel(h.begin())  # the probe's client left: still half-open, and probe-able again
    assert h.available(61.0)


def test_a_request_placed_while_healthy_does_not_close_a_later_ejection() -> None:
    h = Health(errors=1, window=10.0, eject_seconds=30.0)
    before = h.begin()
    assert not before
    assert h.failure(1.0)
    h.success(before)
    assert h.state(2.0) == EJECTED


# -- bounded load and rendezvous ----------------------------------------------------------------


def test_capacity_is_the_factor_times_the_mean_with_the_new_request_counted() -> None:
    idle = [Box("a"), Box("b"), Box("c"), Box("d")]
    assert capacity(idle, 1.25) == 1  # ceil(1.25 * 1 / 4)
    busy = [Box("a", 5), Box("b", 2), Box("c", 1), Box("d", 0)]
    cap = capacity(busy, 1.25)
    assert cap == 3  # ceil(1.25 * 9 / 4)
    assert [overloaded(b, cap) for b in busy] == [True, False, False, False]
    assert least_loaded(busy, [0, 1, 2, 3]) == 3
    assert least_loaded([Box("a", 1), Box("b", 1)], [1, 0]) == 1, "ties go to the earlier in the order"
    # Some replica always has room: the capacity exceeds the mean.
    for loads in ([0, 0], [7, 0, 0], [3, 3, 3, 3], [100, 1]):
        boxes = [Box(str(i), n) for i, n in enumerate(loads)]
        assert any(not overloaded(b, capacity(boxes, 1.0)) for b in boxes)


def test_a_session_leaves_home_only_when_it_is_overloaded_and_far_above_the_least_loaded() -> None:
    # Eight agent sessions on four replicas, seven in flight: three at home is overloaded (cap 3),
    # yet only three beyond the idle replica.
    pool = [Box("home", 3), Box("b", 2), Box("c", 2), Box("d", 0)]
    home, cap = pool[0], capacity(pool, 1.25)
    assert cap == 3 and overloaded(home, cap)
    assert not spills(home, pool, cap, margin=32) and not spills(home, pool, cap, margin=3)
    assert spills(home, pool, cap, margin=2)
    assert spills(home, pool, cap, margin=0), "margin 0: bounded load alone"
    # Far above the others but not overloaded (the whole pool is busy): stays.
    busy = [Box("home", 60), Box("b", 20), Box("c", 20), Box("d", 20)]
    assert not overloaded(busy[0], capacity(busy, 2.0)) and not spills(busy[0], busy, capacity(busy, 2.0), margin=32)
    assert spills(busy[0], busy, capacity(busy, 1.25), margin=32)
    # With margin 0 a replica that is overloaded is always above the least loaded one.
    for loads in ([1, 0], [3, 3, 3, 4], [9, 1, 1, 1], [2, 2, 0]):
        boxes = [Box(str(i), n) for i, n in enumerate(loads)]
        cap = capacity(boxes, 1.0)
        assert all(spills(b, boxes, cap, 0) == overloaded(b, cap) for b in boxes)


def test_rendezvous_moves_only_the_keys_of_a_removed_replica() -> None:
    pool = [Box(f"http://10.0.0.{i}:8000/v1") for i in range(4)]
    keys = [i.to_bytes(16, "big") for i in range(400)]
    first = {k: pool[preference(k, pool)[0]].ident for k in keys}
    counts = {b.ident: sum(1 for v in first.values() if v == b.ident) for b in pool}
    assert all(60 < n < 140 for n in counts.values()), counts  # spread, about 100 each
    gone = pool[2]
    rest = [b for b in pool if b is not gone]
    moved = [k for k in keys if first[k] != gone.ident and rest[preference(k, rest)[0]].ident != first[k]]
    assert moved == []
    # The preference list is the same in any order of the pool (processes may list replicas differently).
    shuffled = pool[::-1]
    assert all(shuffled[preference(k, shuffled)[0]].ident == first[k] for k in keys[:50])


# -- the affinity table ---------------------------------------------------------------------------


async def test_the_affinity_table_finds_the_deepest_known_key_and_stays_bounded() -> None:
    table = LocalAffinity(max_entries=3)
    t = b"tenant"
    await table.remember(t, [b"k2", b"k3"], "http://a/v1")
    await table.remember(t, [b"k5"], "http://b/v1")
    assert await table.lookup(t, [b"k6", b"k5", b"k3"]) == "http://b/v1"
    assert await table.lookup(t, [b"k4", b"k3", b"k2"]) == "http://a/v1"
    await table.remember(t, [b"k7"], "http://c/v1")  # k2 is the least recently used
    assert len(table) == 3
    assert await table.lookup(t, [b"k2"]) is None
    assert await table.lookup(t, [b"k9"]) is None


# -- prompt_cache_key -----------------------------------------------------------------------------


def test_the_conversation_key_is_past_the_leading_system_messages() -> None:
    keys = [b"tools", b"system", b"developer", b"user", b"assistant"]
    msgs = [{"role": "system"}, {"role": "developer"}, {"role": "user"}, {"role": "assistant"}]
    assert conversation_key(keys, msgs) == b"user"
    assert conversation_key(keys[:3], msgs[:2]) == b"developer", "only system messages: the last one"
    assert conversation_key([b"tools", b"u"], [{"role": "user"}]) == b"u"
    assert conversation_key([], []) is None
    key = session_cache_key(b"r" * 16, b"user")
    assert len(key) == 32 and int(key, 16) >= 0
    assert key == session_cache_key(b"r" * 16, b"user") != session_cache_key(b"s" * 16, b"user")


def test_a_key_is_sharded_once_it_carried_rpm_requests_in_a_minute() -> None:
    shards = KeyShards(rpm=2)
    assert [shards.take("k", t) for t in (0.0, 1.0, 2.0, 3.0, 4.0)] == ["k", "k", "k-1", "k-1", "k-2"]
    assert shards.take("other", 4.0) == "other"
    assert shards.take("k", 60.5) == "k", "the first minute's requests of the base key expired"
    assert shards.take("k", 61.0) == "k"
    assert shards.take("k", 61.5) == "k-2", "k-1 still carries two requests of the last minute"
    assert shards.take("k", 63.5) == "k-1", "its first-minute requests expired: the lowest shard with room"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","messages":[]}',
        b'  {\n  "model" : "m",\n "n": 1e400 }\n',
        b'{}',
        b'{ }',
        b'{"model":"m","x":{"prompt_cache_key":"nested"}}',
    ],
)
def test_the_key_is_spliced_in_front_and_the_rest_is_the_clients_bytes(raw: bytes) -> None:
    out = with_prompt_cache_key(raw, "abc")
    start = raw.index(b"{") + 1
    member = b'"prompt_cache_key":"abc"'
    assert out[:start] == raw[:start] and out[start : start + len(member)] == member
    tail = out[start + len(member) :]
    assert tail in (b"," + raw[start:], raw[start:])
    if b"1e400" not in raw:
        parsed = orjson.loads(out)
        assert parsed["prompt_cache_key"] == "abc"
        assert {k: v for k, v in parsed.items() if k != "prompt_cache_key"} == orjson.loads(raw)
    assert with_prompt_cache_key(b"[1]", "abc") == b"[1]"
