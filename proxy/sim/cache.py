"""The reference upstream's prefix cache: chained block hashes with LRU and TTL.

A token sequence is cut into full blocks of ``block_size`` tokens. Block ``i``
is keyed by ``h_i = H(h_{i-1} || tokens of block i)``, so a block is found only
when every token before it matches too (vLLM's automatic prefix caching, and
OpenAI's prompt caching in 128-token steps). A trailing partial block is never
cached.

- :meth:`PrefixCache.lookup` returns how many leading tokens are cached. The
  last token of a prompt is always computed (its logits are what is sampled),
  so at most the full blocks of ``tokens[:-1]`` count. A match shorter than
  ``min_tokens`` counts as none (OpenAI: no hit below 1024 tokens).
- :meth:`PrefixCache.insert` caches the full blocks of a sequence; sequences
  shorter than ``min_tokens`` are not cached at all.
- Entries expire ``ttl`` seconds after their last use; beyond ``capacity``
  blocks the least recently used are evicted. A used chain is touched from its
  last block to its first, so under pressure the deepest blocks go first and a
  chain's root outlives its leaves (as vLLM's free-block queue does).

Time is passed in (``now``): the cache never reads a clock, so tests drive it.
Hashing is the CPU-heavy part and :func:`block_hashes` is pure, so callers may
compute the hashes off the event loop and pass them to ``lookup`` / ``insert``.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence

logger = logging.getLogger(__name__)

_ROOT = b"kvwarm-sim-prefix-cache-root"


def block_hashes(
    tokens: Sequence[int], block_size: int, known: Sequence[bytes] = ()
) -> list[bytes]:
    """Chained hashes of the full blocks of ``tokens``.

    Pure (safe in a worker thread). ``known``: the hashes of the first blocks,
    already computed (for example those of the prompt, when hashing the prompt
    plus the reply); hashing resumes after them.
    """
    count = len(tokens) // block_size
    hashes = list(known[:count])
    previous = hashes[-1] if hashes else _ROOT
    step = block_size * 8  # bytes per block of int64 tokens
    data = array("q", tokens[len(hashes) * block_size : count * block_size]).tobytes()
    blake2b = hashlib.blake2b
    for start in range(0, len(data), step):
        previous = blake2b(previous + data[start : start + step], digest_size=16).digest()
        hashes.append(previous)
    return hashes


class PrefixCache:
    """Chained block hashes of token sequences, bounded by TTL since last use and LRU capacity."""

    __slots__ = ("_blocks", "block_size", "capacity", "min_tokens", "ttl")

    def __init__(self, block_size: int, min_tokens: int, ttl: float, capacity: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        if ttl <= 0:
            raise ValueError("ttl must be > 0")
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.block_size = block_size
        self.min_tokens = min_tokens
        self.ttl = ttl
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, float] = OrderedDict()
        """Block hash -> time of last use, least recently used first."""

    def __len__(self) -> int:
        """Blocks held (expired ones included until they are purged)."""
        return len(self._blocks)

    def block_hashes(self, tokens: Sequence[int], known: Sequence[bytes] = ()) -> list[bytes]:
        """:func:`block_hashes` with this cache's block size."""
        return block_hashes(tokens, self.block_size, known)

    def lookup(
        self, tokens: Sequence[int], now: float, hashes: Sequence[bytes] | None = None
    ) -> int:
        """Leading tokens of ``tokens`` that are cached (0 or a multiple of ``block_size``); touches them.

        ``hashes``: ``self.block_hashes(tokens)`` when already computed (say, off the event loop).
        """
        if len(tokens) < max(self.min_tokens, 1):
            return 0
        if hashes is None:
            hashes = self.block_hashes(tokens)
        limit = (len(tokens) - 1) // self.block_size
        matched: list[bytes] = []
        for key in hashes[:limit]:
            last_used = self._blocks.get(key)
            if last_used is None:
                break
            if now - last_used > self.ttl:
                del self._blocks[key]
                break
            matched.append(key)
        cached = len(matched) * self.block_size
        if cached < self.min_tokens:
            return 0
        self._touch(matched, now)
        return cached

    def insert(
        self, tokens: Sequence[int], now: float, hashes: Sequence[bytes] | None = None
    ) -> int:
        """Cache the full blocks of ``tokens``; returns how many blocks were new."""
        if len(tokens) < self.min_tokens:
            return 0
        if hashes is None:
            hashes = self.block_hashes(tokens)
        self._purge_expired(now)
        new = sum(1 for key in hashes if key not in self._blocks)
        self._touch(hashes, now)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        return new

    def clear(self) -> None:
        """Forget every block."""
        self._blocks.clear()

    def _touch(self, chain: Sequence[bytes], now: float) -> None:
        # Deepest block first, root last: the root ends up most recently used.
        for key in reversed(chain):
            self._blocks[key] = now
            self._blocks.move_to_end(key)

    def _purge_expired(self, now: float) -> None:
        # Ordered by last use, so expired blocks are all at the front.
        while self._blocks:
            key, last_used = next(iter(self._blocks.items()))
            if now - last_used <= self.ttl:
                break
            del self._blocks[key]
