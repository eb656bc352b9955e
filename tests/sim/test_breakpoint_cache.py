"""The breakpoint cache against hand-computed cases: digests, reads, TTL, windows, capacity, fates."""

from __future__ import annotations

import pytest

from proxy.sim.breakpoint_cache import BreakpointCache, prefix_digests, token_bytes

KEY = b"key"


def digests(tokens: list[int], *lengths: int) -> dict[int, bytes]:
    return prefix_digests(token_bytes(tokens), lengths)


def test_prefix_digests_are_those_of_the_prefixes_alone() -> None:
    tokens = list(range(100))
    assert digests(tokens, 10, 50) == {10: digests(tokens[:10], 10)[10], 50: digests(tokens[:50], 50)[50]}
    assert digests(tokens, 10)[10] != digests([*tokens[:9], 999], 10)[10]
    with pytest.raises(ValueError):
        digests(tokens, 101)


def test_a_read_finds_the_longest_live_written_prefix_and_uses_it() -> None:
    cache = BreakpointCache()
    tokens = list(range(3000))
    short, long = digests(tokens, 1200, 2000).values()
    assert cache.write(KEY, 1200, short, 10, now=0)
    assert cache.write(KEY, 2000, long, 5, now=0)
    assert not cache.write(KEY, 2000, long, 5, now=1)  # alive: refreshed, not new
    assert cache.read(KEY, digests(tokens, 1200, 2000, 2500), now=2) == 2000
    assert cache.read(b"other key", digests(tokens, 1200, 2000), now=2) == 0
    assert cache.read(KEY, digests(tokens, 1200, 2000), now=7.5) == 1200  # the longer one expired
    assert cache.fate(KEY, long, now=7.5) == "expired"
    assert cache.fate(KEY, short, now=7.5) == "live"
    assert cache.fate(KEY, b"never written", now=7.5) is None


def test_a_rewrite_lengthens_the_ttl_never_shortens_it() -> None:
    cache = BreakpointCache()
    digest = digests(list(range(2000)), 1500)[1500]
    cache.write(KEY, 1500, digest, 3600, now=0)
    cache.write(KEY, 1500, digest, 300, now=0)
    assert cache.fate(KEY, digest, now=3000) == "live"


def test_a_window_keeps_its_most_recently_used_entries() -> None:
    cache = BreakpointCache(window=3)
    tokens = list(range(5000))
    found = digests(tokens, 1100, 1200, 1300, 1400)
    for length in (1100, 1200, 1300):
        cache.write(KEY, length, found[length], 60, now=0)
    assert cache.read(KEY, {1100: found[1100]}, now=1) == 1100  # used: the most recent now
    cache.write(KEY, 1400, found[1400], 60, now=2)
    assert sorted(cache.recent(KEY, now=3)) == [1100, 1300, 1400]
    assert cache.fate(KEY, found[1200], now=3) == "evicted"
    assert cache.recent(KEY, now=100) == []  # all expired, and forgotten
    assert len(cache) == 0


def test_capacity_evicts_the_least_recently_used_prefixes() -> None:
    cache = BreakpointCache(capacity_tokens=2500)
    a, b = digests(list(range(2000)), 1200).values(), digests(list(range(5000, 7000)), 1200).values()
    (first,), (second,) = a, b
    cache.write(KEY, 1200, first, 60, now=0)
    cache.write(KEY, 1200, second, 60, now=1)
    assert cache.tokens == 2400
    third = digests(list(range(9000, 11000)), 1200)[1200]
    cache.write(KEY, 1200, third, 60, now=2)
    assert cache.fate(KEY, first, now=2) == "evicted"
    assert cache.tokens == 2400
    cache.clear()
    assert (len(cache), cache.tokens, cache.fate(KEY, first, now=2)) == (0, 0, None)
