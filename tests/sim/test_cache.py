"""The prefix cache against hand-computed cases (OpenAI and vLLM block rules, TTL, LRU)."""

from __future__ import annotations

import pytest

from proxy.sim.cache import PrefixCache, block_hashes


def openai_cache(ttl: float = 3600.0, capacity: int = 100_000) -> PrefixCache:
    return PrefixCache(block_size=128, min_tokens=1024, ttl=ttl, capacity=capacity)


def vllm_cache(ttl: float = 3600.0, capacity: int = 100_000) -> PrefixCache:
    return PrefixCache(block_size=16, min_tokens=0, ttl=ttl, capacity=capacity)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_openai_prompt_below_1024_is_never_cached() -> None:
    cache = openai_cache()
    prompt = tokens(1000)
    assert cache.lookup(prompt, now=0) == 0
    cache.insert(prompt, now=0)
    assert cache.lookup(prompt, now=1) == 0
    assert len(cache) == 0


def test_openai_second_identical_prompt_is_cached_in_128_steps() -> None:
    cache = openai_cache()
    prompt = tokens(1300)
    assert cache.lookup(prompt, now=0) == 0
    assert cache.insert(prompt, now=0) == 10  # 10 full blocks; the 20-token tail is not cached
    assert cache.lookup(prompt, now=1) == 1280


def test_openai_extension_and_drift() -> None:
    cache = openai_cache()
    cache.insert(tokens(1300), now=0)
    assert cache.lookup(tokens(1300) + tokens(500, start=5000), now=1) == 1280
    drifted_late = tokens(1500)
    drifted_late[1100] = 99_999  # inside block 8 (tokens 1024..1151)
    assert cache.lookup(drifted_late, now=1) == 1024
    drifted_early = tokens(1500)
    drifted_early[500] = 99_999  # only 3 blocks match: below the 1024-token minimum
    assert cache.lookup(drifted_early, now=1) == 0


def test_the_last_token_is_never_cached() -> None:
    cache = openai_cache()
    cache.insert(tokens(1280), now=0)
    assert cache.lookup(tokens(1280), now=1) == 1152
    assert cache.lookup(tokens(1281), now=1) == 1280

    small = vllm_cache()
    small.insert(tokens(32), now=0)
    assert small.lookup(tokens(32), now=1) == 16
    assert small.lookup(tokens(33), now=1) == 32


def test_vllm_blocks_of_16_without_minimum() -> None:
    cache = vllm_cache()
    assert cache.insert(tokens(100), now=0) == 6
    assert cache.lookup(tokens(100), now=1) == 96
    assert cache.lookup(tokens(40), now=1) == 32
    drifted = tokens(100)
    drifted[40] = 99_999
    assert cache.lookup(drifted, now=1) == 32
    assert cache.lookup([7, *tokens(99, start=1)], now=1) == 0  # first token differs: nothing
    assert cache.lookup(tokens(10), now=1) == 0


def test_block_hashes_are_chained() -> None:
    cache = vllm_cache()
    a = tokens(32)
    b = [99_999, *tokens(15, start=1), *tokens(16, start=16)]  # same second block, other first
    assert cache.block_hashes(a)[1] != cache.block_hashes(b)[1]
    assert cache.block_hashes(a) == cache.block_hashes(tokens(40))


def test_block_hashes_resume_from_known_prefix_hashes() -> None:
    prompt, generated = tokens(100), tokens(150)
    known = block_hashes(prompt, 16)
    assert len(known) == 6
    assert block_hashes(generated, 16, known) == block_hashes(generated, 16)
    cache = vllm_cache()
    cache.insert(generated, now=0, hashes=block_hashes(generated, 16, known))
    assert cache.lookup(generated, now=1, hashes=cache.block_hashes(generated)) == 144


def test_ttl_counts_from_last_use() -> None:
    cache = vllm_cache(ttl=10)
    prompt = tokens(64)
    cache.insert(prompt, now=0)
    assert cache.lookup(prompt, now=10) == 48  # exactly the TTL: still alive, and touched
    assert cache.lookup(prompt, now=19) == 48  # 9 s after the last use
    assert cache.lookup(prompt, now=29.5) == 0  # 10.5 s after the last use
    cache.insert(tokens(16, start=1000), now=29.5)  # purges what expired
    assert len(cache) == 1


def test_lru_eviction_at_capacity() -> None:
    cache = vllm_cache(capacity=4)
    a, b, c = tokens(33, start=0), tokens(33, start=1000), tokens(33, start=2000)
    cache.insert(a, now=0)
    cache.insert(b, now=1)
    assert cache.lookup(a, now=2) == 32  # a is now more recent than b
    cache.insert(c, now=3)
    assert len(cache) == 4
    assert cache.lookup(a, now=4) == 32
    assert cache.lookup(c, now=4) == 32
    assert cache.lookup(b, now=4) == 0


def test_eviction_takes_the_deepest_block_of_a_chain_first() -> None:
    cache = vllm_cache(capacity=3)
    a, b = tokens(33, start=0), tokens(33, start=1000)
    cache.insert(a, now=0)
    cache.insert(b, now=1)  # one block of a must go: its leaf, not its root
    assert cache.lookup(a, now=2) == 16
    assert cache.lookup(b, now=2) == 32


def test_clear_forgets_everything() -> None:
    cache = vllm_cache()
    cache.insert(tokens(64), now=0)
    cache.clear()
    assert len(cache) == 0
    assert cache.lookup(tokens(64), now=0) == 0


@pytest.mark.parametrize(
    ("block_size", "min_tokens", "ttl", "capacity"),
    [(0, 0, 1.0, 1), (16, -1, 1.0, 1), (16, 0, 0.0, 1), (16, 0, 1.0, 0)],
)
def test_invalid_parameters_are_refused(
    block_size: int, min_tokens: int, ttl: float, capacity: int
) -> None:
    with pytest.raises(ValueError):
        PrefixCache(block_size, min_tokens, ttl, capacity)
