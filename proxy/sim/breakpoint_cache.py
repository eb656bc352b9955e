"""The breakpoint cache: the prompt prefixes requests asked to have written, each read back whole.

Where the block cache (:mod:`.cache`) keeps every full block of every prompt, a
provider with cache breakpoints keeps exactly the prefixes requests marked: the
tokens up to a breakpoint (:mod:`.markers` says where those are). An entry is
one written prefix: its length, the digest of its tokens (:func:`prefix_digests`),
its TTL and its last use. A later prompt *reads* an entry when it starts with
the entry's tokens (same length, same digest); the boundary is exact, never
rounded to a block.

- **Keys.** Entries live under a key (:mod:`.markers`: the model and, for
  OpenAI, the ``prompt_cache_key`` and the first 256 tokens, what routes a
  request); a prompt reads only entries under its own key.
- **Windows.** With ``window`` set (OpenAI: 80), a key keeps its ``window``
  most recently used entries and forgets older ones (as evicted), and
  :meth:`recent` lists the lengths a prompt may read: every entry of the
  window, with no lookback limit. Without one (Anthropic) a prompt names the
  lengths it looks at: its breakpoints and the blocks just before them.
- **TTL.** An entry expires ``ttl`` seconds after its last use. A read or a
  rewrite is a use (Anthropic: a cache entry is refreshed each time it is read);
  a rewrite with a longer TTL lengthens it.
- **Capacity.** Beyond ``capacity_tokens`` (the sum of the entries' lengths:
  each written prefix is held whole) or ``max_entries`` entries, the least
  recently used entries are evicted.
- **Fates.** What became of a forgotten entry (``expired`` or ``evicted``) is
  remembered for a while, so the prompt-cache diagnostics
  (:mod:`.diagnostics`) can say why a prefix was not read.

Pure: time is passed in (``now``); nothing here reads a clock.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_MAX_ENTRIES = 100_000
FATES_KEPT = 10_000
"""How many forgotten entries' fates are remembered (oldest forgotten first)."""
_TOKEN_BYTES = 8
_PERSON = b"kvwarm-sim-bp"

EntryId = tuple[bytes, bytes]
"""An entry's key and the digest of its tokens."""


def token_bytes(tokens: Sequence[int]) -> bytes:
    """The tokens as the bytes :func:`prefix_digests` hashes (int64 each)."""
    return array("q", tokens).tobytes()


def prefix_digests(data: bytes, lengths: Iterable[int]) -> dict[int, bytes]:
    """Length -> digest of the first ``length`` tokens of ``data`` (:func:`token_bytes`).

    One pass over the tokens however many lengths are asked for. Pure (safe in a
    worker thread). ``ValueError`` for a length outside the tokens.
    """
    view = memoryview(data)
    hasher = hashlib.blake2b(digest_size=16, person=_PERSON)
    digests: dict[int, bytes] = {}
    done = 0
    for length in sorted(set(lengths)):
        if length < 0 or length * _TOKEN_BYTES > len(data):
            raise ValueError(f"no prefix of {length} tokens in {len(data) // _TOKEN_BYTES} tokens")
        hasher.update(view[done * _TOKEN_BYTES : length * _TOKEN_BYTES])
        done = length
        digests[length] = hasher.copy().digest()
    return digests


@dataclass(slots=True, kw_only=True)
class _Entry:
    length: int
    ttl: float
    last_used: float

    def expired(self, now: float) -> bool:
        return now - self.last_used > self.ttl


class BreakpointCache:
    """Written prefixes by key and digest, each alive ``ttl`` seconds since its last use."""

    __slots__ = ("_entries", "_fates", "_tokens", "_windows", "capacity_tokens", "max_entries", "window")

    def __init__(
        self,
        *,
        window: int | None = None,
        capacity_tokens: int | None = None,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        if window is not None and window < 1:
            raise ValueError("window must be >= 1")
        if capacity_tokens is not None and capacity_tokens < 1:
            raise ValueError("capacity_tokens must be >= 1")
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.window = window
        self.capacity_tokens = capacity_tokens
        self.max_entries = max_entries
        self._entries: OrderedDict[EntryId, _Entry] = OrderedDict()
        """Every entry, least recently used first."""
        self._windows: dict[bytes, OrderedDict[bytes, None]] = {}
        """Key -> its entries' digests, least recently used first (only with a ``window``)."""
        self._fates: OrderedDict[EntryId, str] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        """Entries held (expired ones included until they are noticed)."""
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """The sum of the entries' lengths: what ``capacity_tokens`` bounds."""
        return self._tokens

    def recent(self, key: bytes, now: float) -> list[int]:
        """The lengths of the live entries in ``key``'s window (expired ones are forgotten)."""
        window = self._windows.get(key)
        lengths: list[int] = []
        for digest in list(window or ()):
            entry = self._entries[(key, digest)]
            if entry.expired(now):
                self._forget((key, digest), "expired")
            else:
                lengths.append(entry.length)
        return lengths

    def read(self, key: bytes, digests: Mapping[int, bytes], now: float) -> int:
        """The longest live entry among ``digests`` (length -> digest of the prompt's prefix);
        0 when none. The entry read is used (its TTL starts again)."""
        best, hit = 0, None
        for length in sorted(digests, reverse=True):
            ident = (key, digests[length])
            entry = self._entries.get(ident)
            if entry is None or entry.length != length:
                continue
            if entry.expired(now):
                self._forget(ident, "expired")
                continue
            best, hit = length, ident
            break
        if hit is not None:
            self._touch(hit, now)
        return best

    def write(self, key: bytes, length: int, digest: bytes, ttl: float, now: float) -> bool:
        """Hold the prefix of ``length`` tokens whose digest is ``digest`` for ``ttl`` seconds
        since its last use. Returns whether it is new (False: it was alive, and is refreshed)."""
        ident = (key, digest)
        entry = self._entries.get(ident)
        if entry is not None and not entry.expired(now):
            entry.ttl = max(entry.ttl, ttl)
            self._touch(ident, now)
            return False
        if entry is not None:
            self._forget(ident, "expired")
        self._purge_expired(now)
        self._entries[ident] = _Entry(length=length, ttl=ttl, last_used=now)
        self._tokens += length
        self._fates.pop(ident, None)
        if self.window is not None:
            window = self._windows.setdefault(key, OrderedDict())
            window[digest] = None
            while len(window) > self.window:
                self._forget((key, next(iter(window))), "evicted")
        self._evict(now)
        return True

    def fate(self, key: bytes, digest: bytes, now: float) -> str | None:
        """``"live"``, ``"expired"``, ``"evicted"``, or ``None`` (never written, or long forgotten)."""
        entry = self._entries.get((key, digest))
        if entry is not None:
            return "expired" if entry.expired(now) else "live"
        return self._fates.get((key, digest))

    def clear(self) -> None:
        """Forget every entry and every fate."""
        self._entries.clear()
        self._windows.clear()
        self._fates.clear()
        self._tokens = 0

    def _touch(self, ident: EntryId, now: float) -> None:
        self._entries[ident].last_used = now
        self._entries.move_to_end(ident)
        if self.window is not None:
            self._windows[ident[0]].move_to_end(ident[1])

    def _forget(self, ident: EntryId, fate: str) -> None:
        entry = self._entries.pop(ident)
        self._tokens -= entry.length
        window = self._windows.get(ident[0])
        if window is not None:
            del window[ident[1]]
            if not window:
                del self._windows[ident[0]]
        self._fates[ident] = fate
        self._fates.move_to_end(ident)
        while len(self._fates) > FATES_KEPT:
            self._fates.popitem(last=False)

    def _purge_expired(self, now: float) -> None:
        # Least recently used first; TTLs differ, so this stops at the first live
        # entry and leaves later expired ones to be noticed when they are looked at.
        while self._entries:
            ident, entry = next(iter(self._entries.items()))
            if not entry.expired(now):
                break
            self._forget(ident, "expired")

    def _evict(self, now: float) -> None:
        capacity = self.capacity_tokens
        while self._entries and (
            len(self._entries) > self.max_entries
            or (capacity is not None and self._tokens > capacity)
        ):
            ident, entry = next(iter(self._entries.items()))
            self._forget(ident, "expired" if entry.expired(now) else "evicted")
