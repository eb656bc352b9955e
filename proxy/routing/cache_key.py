"""``prompt_cache_key`` for OpenAI-style providers: one stable key per conversation, sharded when hot.

OpenAI routes a request to a cache machine by a hash of its first ~256 tokens
combined with ``prompt_cache_key``; one prefix+key is served by one machine up to
about 15 requests a minute, beyond which requests overflow to other machines (and
miss). Without a key, every session that shares a system prompt shares one route
and overflows together. With ``routing.prompt_cache_key = "session"`` kvwarm gives
each conversation its own key when the client sent none:

**Derivation.** The chain key of the conversation's first message past its leading
``system`` / ``developer`` messages (``plan.match.keys[k]``): tenant-rooted, blind to
formatting drift, the same on every turn of the conversation, and shared only by
requests that share that whole prefix (a fork, a retry). It is HMAC'd with a fixed
label (:data:`LABEL`) so the provider sees a value that names nothing kvwarm stores
and says nothing about the tenant or the text: 32 hex characters.
(The first message itself would be shared by every session of a system prompt:
one key for all of them is the overflow the key exists to avoid.)

**Sharding.** :class:`KeyShards` counts the requests of each key in a sliding
minute; once a key carried ``rpm`` of them, the next one goes to ``<key>-1``, then
``<key>-2`` ... (the lowest shard with room), so no key is pushed past the rate at
which the provider spills it anyway.

**Bytes.** :func:`with_prompt_cache_key` splices the member in right after the
body's opening ``{``: the client's bytes are otherwise forwarded as they are.
A client's own key (any ``prompt_cache_key`` member, even ``null``) is never
replaced.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

__all__ = ["FIELD", "LABEL", "KeyShards", "conversation_key", "session_cache_key", "with_prompt_cache_key"]

FIELD = "prompt_cache_key"
LABEL = b"kvwarm prompt_cache_key v1"
KEY_HEX = 32
WINDOW = 60.0
"""Seconds of the sliding minute."""
MAX_TRACKED = 65536
"""Keys whose recent requests are counted at once (the least recently used are forgotten)."""
_LEADING_ROLES = frozenset({"system", "developer"})


def conversation_key(keys: Sequence[bytes], messages: Sequence[Any]) -> bytes | None:
    """The chain key through the first message past the leading system/developer ones.

    ``keys`` are a plan's element keys (0 = tools, 1.. = messages), ``messages`` the
    forwarded messages (chat-shaped: the Responses ``instructions`` are a system message).
    """
    if not keys:
        return None
    k = 0
    while k < len(messages) and isinstance(messages[k], Mapping) and messages[k].get("role") in _LEADING_ROLES:
        k += 1
    return keys[min(k + 1, len(keys) - 1)]


def session_cache_key(root: bytes, key: bytes) -> str:
    """The provider-facing key of a conversation: HMAC(label, tenant root || chain key), hex."""
    return hmac.new(LABEL, root + key, hashlib.sha256).hexdigest()[:KEY_HEX]


class KeyShards:
    """Per key, the requests of the last minute, by shard; picks the lowest shard with room."""

    __slots__ = ("_seen", "max_tracked", "rpm")

    def __init__(self, rpm: int = 15, max_tracked: int = MAX_TRACKED) -> None:
        self.rpm = max(1, rpm)
        self.max_tracked = max(1, max_tracked)
        self._seen: OrderedDict[str, list[deque[float]]] = OrderedDict()
        """key -> per shard, the times of its requests within the window."""

    def take(self, key: str, now: float) -> str:
        """The key (or shard) this request carries; counts it."""
        seen = self._seen
        shards = seen.get(key)
        if shards is None:
            shards = seen[key] = []
            while len(seen) > self.max_tracked:
                seen.popitem(last=False)
        else:
            seen.move_to_end(key)
        for n, times in enumerate(shards):
            while times and now - times[0] >= WINDOW:
                times.popleft()
            if len(times) < self.rpm:
                times.append(now)
                return key if n == 0 else f"{key}-{n}"
        shards.append(deque([now]))
        n = len(shards) - 1
        return key if n == 0 else f"{key}-{n}"


def with_prompt_cache_key(raw: bytes, key: str) -> bytes:
    """``raw`` (a JSON object's bytes) with ``"prompt_cache_key": key`` as its first member;
    ``raw`` unchanged when it is not an object."""
    start = raw.find(b"{")
    if start < 0 or raw[:start].strip():
        return raw
    rest = raw[start + 1 :]
    member = b'"' + FIELD.encode() + b'":' + orjson.dumps(key)
    return raw[: start + 1] + member + (b"," if rest.lstrip()[:1] != b"}" else b"") + rest
