"""Every usage shape a provider reports, read into one :class:`Usage` value.

Shapes read (from a non-streaming body, from one parsed SSE chunk, or from the ``response``
of a Responses stream's ``response.completed`` event):

* **OpenAI** chat completions: ``usage.prompt_tokens``, ``completion_tokens``,
  ``prompt_tokens_details.cached_tokens`` and ``.cache_write_tokens`` (GPT-5.6 and later, and
  OpenRouter), ``completion_tokens_details.reasoning_tokens``; the Responses-API spelling
  (``input_tokens`` with ``input_tokens_details``, ``output_tokens_details``); the split of the
  writes by TTL in ``*_tokens_details.cache_write_tokens_details`` (``ttl_30m_tokens``,
  ``ttl_12h_tokens``); OpenRouter's ``usage.cost``;
* **openhuman**: ``openhuman.usage`` (``input_tokens``, ``output_tokens``,
  ``cached_input_tokens``) wins over the standard block field by field, and
  ``openhuman.billing.charged_amount_usd`` is the billed cost;
* **Anthropic-style** inside ``usage`` (Anthropic itself, and routers that add these fields to
  chat usage): ``input_tokens``, ``output_tokens``, ``cache_read_input_tokens``,
  ``cache_creation_input_tokens`` and its split by TTL ``cache_creation``
  (``ephemeral_5m_input_tokens``, ``ephemeral_1h_input_tokens``). Anthropic's ``input_tokens``
  excludes cache reads and writes, so the prompt is normalized to
  ``input + cache_read + cache_creation``;
* **DeepSeek**: ``prompt_cache_hit_tokens`` / ``prompt_cache_miss_tokens``;
* **llama.cpp** ``timings`` (``cache_n``, ``prompt_n``, ``predicted_n``, the
  ``*_ms`` figures): when nothing else gives the cached count, it is
  ``cache_n``; the prompt is ``cache_n + prompt_n`` when usage lacks it.

A missing cached-token or cache-write count is *unknown* (``None``), never zero: the
cache-hit ratio must not count a provider that does not report caching as a miss, and a
provider that does not report writes has not been seen writing. A reported zero is a known
zero. Garbage (strings, negatives, booleans, NaN) in a field drops that field; nothing here
raises on a malformed body.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeGuard, TypeVar

__all__ = [
    "UNKNOWN_TTL",
    "WRITE_TTLS",
    "Usage",
    "extract_usage",
    "is_mapping",
    "is_usage_only_chunk",
    "merge_usage",
]

_T = TypeVar("_T")

WRITE_TTLS: Final = ("5m", "1h", "30m", "12h")
"""The cache-write TTL buckets providers report: Anthropic's 5 minutes and 1 hour, OpenAI's
30 minutes and 12 hours."""
UNKNOWN_TTL: Final = "unknown"
"""The bucket of written tokens whose TTL the provider did not say."""


@dataclass(init=False, unsafe_hash=True)  # built for every response (proxy/core/values.py)
class Usage:
    """Token counts (and the billed cost, when a provider bills) of one response.

    Built by keyword only: most fields are token counts of the same type, and a count in the
    wrong place would go unnoticed. A field not given is not known.
    """

    prompt_tokens: Final[int | None]
    """All prompt tokens, cached and written ones included (normalized across shapes)."""
    completion_tokens: Final[int | None]
    """Generated tokens, reasoning tokens included."""
    cached_tokens: Final[int | None]
    """Prompt tokens read from the provider's cache; ``None`` = not reported (unknown)."""
    cache_write_tokens: Final[int | None]
    """Prompt tokens written to the provider's cache, every TTL; ``None`` = not reported
    (unknown). Never less than the TTL split below adds up to, when read from a response."""
    cache_write_5m_tokens: Final[int | None]
    """Of ``cache_write_tokens``, those written for 5 minutes (Anthropic), when reported."""
    cache_write_1h_tokens: Final[int | None]
    """Those written for an hour (Anthropic), when reported."""
    cache_write_30m_tokens: Final[int | None]
    """Those written for 30 minutes (OpenAI), when reported."""
    cache_write_12h_tokens: Final[int | None]
    """Those written for 12 hours (OpenAI), when reported."""
    reasoning_tokens: Final[int | None]
    """The part of ``completion_tokens`` spent on reasoning, when reported."""
    billed_usd: Final[float | None]
    """What the provider charged (``openhuman.billing.charged_amount_usd``, OpenRouter ``usage.cost``)."""
    source: Final[str]
    """The shape the cached count came from: ``openai``, ``openhuman``, ``anthropic``,
    ``deepseek`` or ``llamacpp``; ``openai`` when there is no cached count."""
    timings: Final[Mapping[str, float] | None]
    """llama.cpp's ``timings`` block (``cache_n``, ``prompt_n``, ``prompt_ms``, ...), numbers only."""

    def __init__(
        self,
        *,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        cached_tokens: int | None = None,
        cache_write_tokens: int | None = None,
        cache_write_5m_tokens: int | None = None,
        cache_write_1h_tokens: int | None = None,
        cache_write_30m_tokens: int | None = None,
        cache_write_12h_tokens: int | None = None,
        reasoning_tokens: int | None = None,
        billed_usd: float | None = None,
        source: str = "openai",
        timings: Mapping[str, float] | None = None,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.cached_tokens = cached_tokens
        self.cache_write_tokens = cache_write_tokens
        self.cache_write_5m_tokens = cache_write_5m_tokens
        self.cache_write_1h_tokens = cache_write_1h_tokens
        self.cache_write_30m_tokens = cache_write_30m_tokens
        self.cache_write_12h_tokens = cache_write_12h_tokens
        self.reasoning_tokens = reasoning_tokens
        self.billed_usd = billed_usd
        self.source = source
        self.timings = timings

    def writes_by_ttl(self) -> list[tuple[str, int]]:
        """The written tokens by TTL bucket (:data:`WRITE_TTLS`): each reported bucket, and the
        rest of ``cache_write_tokens`` under :data:`UNKNOWN_TTL` (also a reported total of zero
        that has no split). Empty when no write count is known."""
        out: list[tuple[str, int]] = []
        split = 0
        for ttl, count in (
            ("5m", self.cache_write_5m_tokens),
            ("1h", self.cache_write_1h_tokens),
            ("30m", self.cache_write_30m_tokens),
            ("12h", self.cache_write_12h_tokens),
        ):
            if count is not None:
                out.append((ttl, count))
                split += count
        total = self.cache_write_tokens
        if total is not None and (total > split or not out):
            out.append((UNKNOWN_TTL, total - split))
        return out


def extract_usage(obj: Mapping[str, Any]) -> Usage | None:
    """Read the usage of a chat.completion body, of one chat.completion.chunk, or of a Responses
    API response.

    Returns ``None`` when ``obj`` carries no usage at all (no readable count,
    no billed cost, no timings).
    """
    if type(obj) is dict:
        if "openhuman" not in obj and "timings" not in obj:
            usage_block = obj.get("usage")
            if type(usage_block) is dict:
                fast = _openai_usage(usage_block)
                if fast is not None:
                    return fast
            elif usage_block is None:
                return None  # a stream's content chunk: nothing any shape could read
    elif not isinstance(obj, Mapping):
        return None
    return _extract(obj)


def _extract(obj: Mapping[str, Any]) -> Usage | None:
    """:func:`extract_usage`, every shape."""
    usage = _mapping(obj.get("usage"))
    openhuman = _mapping(obj.get("openhuman"))
    oh_usage = _mapping(openhuman.get("usage"))
    timings = _timings(obj.get("timings"))
    details = _mapping(usage.get("prompt_tokens_details")) or _mapping(usage.get("input_tokens_details"))
    completion_details = _mapping(usage.get("completion_tokens_details")) or _mapping(
        usage.get("output_tokens_details")
    )
    writes = _CacheWrites.read(usage, details)
    prompt, completion = _token_totals(usage, oh_usage, timings, writes.total)
    cached, source = _cached(usage, details, oh_usage, timings)
    reasoning = _count(completion_details.get("reasoning_tokens"))

    billed = _usd(_mapping(openhuman.get("billing")).get("charged_amount_usd"))
    if billed is None and usage.get("is_byok") is not True:
        # OpenRouter bills in credits of one USD; with BYOK `cost` is only its fee.
        billed = _usd(usage.get("cost"))

    if (
        prompt is None
        and completion is None
        and cached is None
        and writes.total is None
        and reasoning is None
        and billed is None
        and not timings
    ):
        return None
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        cache_write_tokens=writes.total,
        cache_write_5m_tokens=writes.ttl_5m,
        cache_write_1h_tokens=writes.ttl_1h,
        cache_write_30m_tokens=writes.ttl_30m,
        cache_write_12h_tokens=writes.ttl_12h,
        reasoning_tokens=reasoning,
        billed_usd=billed,
        source=source,
        timings=timings or None,
    )


@dataclass(init=False, unsafe_hash=True)  # built for every usage block read
class _CacheWrites:
    """The cache-write counts of one usage block: the total and its split by TTL."""

    total: Final[int | None]
    ttl_5m: Final[int | None]
    ttl_1h: Final[int | None]
    ttl_30m: Final[int | None]
    ttl_12h: Final[int | None]

    def __init__(
        self, *, total: int | None, ttl_5m: int | None, ttl_1h: int | None, ttl_30m: int | None, ttl_12h: int | None
    ) -> None:
        self.total = total
        self.ttl_5m = ttl_5m
        self.ttl_1h = ttl_1h
        self.ttl_30m = ttl_30m
        self.ttl_12h = ttl_12h

    @staticmethod
    def read(usage: Mapping[str, Any], details: Mapping[str, Any]) -> _CacheWrites:
        """Anthropic's ``cache_creation_input_tokens`` (split in ``cache_creation``), else
        OpenAI's and OpenRouter's ``*_tokens_details.cache_write_tokens`` (split in its
        ``cache_write_tokens_details``). A total missing or below its split is the split's sum."""
        creation = _mapping(usage.get("cache_creation"))
        split = _mapping(details.get("cache_write_tokens_details"))
        ttl_5m = _count(creation.get("ephemeral_5m_input_tokens"))
        ttl_1h = _count(creation.get("ephemeral_1h_input_tokens"))
        ttl_30m = _count(split.get("ttl_30m_tokens"))
        ttl_12h = _count(split.get("ttl_12h_tokens"))
        total = _count(usage.get("cache_creation_input_tokens"))
        if total is None:
            total = _count(details.get("cache_write_tokens"))
        parts = [n for n in (ttl_5m, ttl_1h, ttl_30m, ttl_12h) if n is not None]
        if parts:
            total = max(total or 0, sum(parts))
        return _CacheWrites(total=total, ttl_5m=ttl_5m, ttl_1h=ttl_1h, ttl_30m=ttl_30m, ttl_12h=ttl_12h)


_OPENAI_KEYS = frozenset(
    ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details", "completion_tokens_details")
)
_PROMPT_DETAIL_KEYS = frozenset(("cached_tokens", "cache_write_tokens", "audio_tokens"))
_COMPLETION_DETAIL_KEYS = frozenset(
    ("reasoning_tokens", "audio_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens")
)
_RESPONSES_KEYS = frozenset(
    ("input_tokens", "output_tokens", "total_tokens", "input_tokens_details", "output_tokens_details")
)
_INPUT_DETAIL_KEYS = frozenset(("cached_tokens", "cache_write_tokens"))
_OUTPUT_DETAIL_KEYS = frozenset(("reasoning_tokens",))


def _openai_usage(usage: dict[str, Any]) -> Usage | None:
    """The usage block OpenAI and most OpenAI-compatible servers send, Chat Completions' or the
    Responses API's (plain counts, only the keys above: no TTL split), read directly; None for
    anything else, which :func:`_extract` reads. Gives exactly what :func:`_extract` gives for
    such a block (property-tested)."""
    if _OPENAI_KEYS.issuperset(usage):
        names = ("prompt_tokens", "completion_tokens", "prompt_tokens_details", "completion_tokens_details")
        keys = (_PROMPT_DETAIL_KEYS, _COMPLETION_DETAIL_KEYS)
    elif _RESPONSES_KEYS.issuperset(usage):  # input_tokens include the cached ones
        names = ("input_tokens", "output_tokens", "input_tokens_details", "output_tokens_details")
        keys = (_INPUT_DETAIL_KEYS, _OUTPUT_DETAIL_KEYS)
    else:
        return None
    prompt = usage.get(names[0])
    completion = usage.get(names[1])
    if type(prompt) is not int or prompt < 0 or type(completion) is not int or completion < 0:
        return None
    prompt_details = usage.get(names[2])
    if not _plain_detail(prompt_details, keys[0]):
        return None
    completion_details = usage.get(names[3])
    if not _plain_detail(completion_details, keys[1]):
        return None
    cached = written = reasoning = None
    if prompt_details:
        cached = prompt_details.get("cached_tokens")
        written = prompt_details.get("cache_write_tokens")
    if completion_details:
        reasoning = completion_details.get("reasoning_tokens")
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        cache_write_tokens=written,
        reasoning_tokens=reasoning,
    )


def _plain_detail(details: Any, keys: frozenset[str]) -> bool:
    """Whether a ``*_tokens_details`` block is absent, or holds only ``keys``, each a plain
    count (an int >= 0) or absent."""
    if details is None:
        return True
    if type(details) is not dict or not keys.issuperset(details):
        return False
    for count in details.values():
        if count is not None and (type(count) is not int or count < 0):
            return False
    return True


def _token_totals(
    usage: Mapping[str, Any], oh_usage: Mapping[str, Any], timings: Mapping[str, float], written: int | None
) -> tuple[int | None, int | None]:
    """Prompt (cached and written included) and completion tokens, from whichever shape the
    response uses; ``written``: the cache writes read from it."""
    prompt = _count(usage.get("prompt_tokens"))
    completion = _count(usage.get("completion_tokens"))
    input_tokens = _count(usage.get("input_tokens"))
    hit = _count(usage.get("prompt_cache_hit_tokens"))
    miss = _count(usage.get("prompt_cache_miss_tokens"))
    if prompt is None:
        if hit is not None and miss is not None:
            prompt = hit + miss
        elif input_tokens is not None:
            if _mapping(usage.get("input_tokens_details")):
                # Responses API: input_tokens already includes the cached and written tokens.
                prompt = input_tokens
            else:
                # Anthropic: input_tokens counts only what was neither read nor written.
                cache_read = _count(usage.get("cache_read_input_tokens")) or 0
                prompt = input_tokens + cache_read + (written or 0)
    if completion is None:
        completion = _count(usage.get("output_tokens"))
    # openhuman's block wins field by field; the standard block is the fallback.
    oh_prompt = _count(oh_usage.get("input_tokens"))
    oh_completion = _count(oh_usage.get("output_tokens"))
    if oh_prompt is not None:
        prompt = oh_prompt
    if oh_completion is not None:
        completion = oh_completion
    if timings:
        cache_n = _count(timings.get("cache_n"))
        prompt_n = _count(timings.get("prompt_n"))
        if prompt is None and cache_n is not None and prompt_n is not None:
            prompt = cache_n + prompt_n
        if completion is None:
            completion = _count(timings.get("predicted_n"))
    return prompt, completion


def _cached(
    usage: Mapping[str, Any],
    details: Mapping[str, Any],
    oh_usage: Mapping[str, Any],
    timings: Mapping[str, float],
) -> tuple[int | None, str]:
    """The cached prompt tokens and the shape that reported them (None: unknown, not zero)."""
    for count, shape in (
        (_count(oh_usage.get("cached_input_tokens")), "openhuman"),
        (_count(usage.get("prompt_cache_hit_tokens")), "deepseek"),
        (_count(usage.get("cache_read_input_tokens")), "anthropic"),
        (_count(details.get("cached_tokens")), "openai"),
        (_count(timings.get("cache_n")) if timings else None, "llamacpp"),
    ):
        if count is not None:
            return count, shape
    return None, "openai"


def merge_usage(a: Usage | None, b: Usage | None) -> Usage | None:
    """Combine usage read from two chunks of one stream: ``b``'s known fields win.

    Usage may arrive split (llama.cpp sends ``timings`` on the finish chunk and
    ``usage`` on the usage-only chunk); a field ``b`` does not know keeps
    ``a``'s value. ``source`` follows the cached count it describes.
    """
    if a is None:
        return b
    if b is None:
        return a
    if b.cached_tokens is not None:
        source = b.source
    elif a.cached_tokens is not None:
        source = a.source
    else:
        source = b.source
    timings: Mapping[str, float] | None
    if a.timings and b.timings:
        timings = {**a.timings, **b.timings}
    else:
        timings = b.timings or a.timings
    return Usage(
        prompt_tokens=_later(a.prompt_tokens, b.prompt_tokens),
        completion_tokens=_later(a.completion_tokens, b.completion_tokens),
        cached_tokens=_later(a.cached_tokens, b.cached_tokens),
        cache_write_tokens=_later(a.cache_write_tokens, b.cache_write_tokens),
        cache_write_5m_tokens=_later(a.cache_write_5m_tokens, b.cache_write_5m_tokens),
        cache_write_1h_tokens=_later(a.cache_write_1h_tokens, b.cache_write_1h_tokens),
        cache_write_30m_tokens=_later(a.cache_write_30m_tokens, b.cache_write_30m_tokens),
        cache_write_12h_tokens=_later(a.cache_write_12h_tokens, b.cache_write_12h_tokens),
        reasoning_tokens=_later(a.reasoning_tokens, b.reasoning_tokens),
        billed_usd=_later(a.billed_usd, b.billed_usd),
        source=source,
        timings=timings,
    )


def is_usage_only_chunk(obj: Mapping[str, Any]) -> bool:
    """A chat.completion.chunk with ``choices == []`` and a usage block.

    This is the extra chunk an upstream sends for ``stream_options.include_usage``;
    kvwarm removes it from the client's stream when kvwarm added that option.
    """
    if not is_mapping(obj):
        return False
    choices = obj.get("choices")
    if not isinstance(choices, list) or choices:
        return False
    if obj.get("object", "chat.completion.chunk") != "chat.completion.chunk":
        return False
    usage = obj.get("usage")
    return is_mapping(usage) and bool(usage)


def _later(a: _T | None, b: _T | None) -> _T | None:
    return a if b is None else b


def is_mapping(value: object) -> TypeGuard[Mapping[Any, Any]]:
    """A JSON object: a dict, what orjson gives, tested first (an ``isinstance`` against the
    ``Mapping`` ABC runs a Python frame), or any other ``Mapping``."""
    return type(value) is dict or isinstance(value, Mapping)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if is_mapping(value) else _EMPTY


_EMPTY: Mapping[str, Any] = {}


def _count(value: Any) -> int | None:
    """A token count: a non-negative integer (an integral float is accepted), else None."""
    if value is None:
        return None
    if type(value) is int:
        return value if value >= 0 else None
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return None


def _usd(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    amount = float(value)
    return amount if math.isfinite(amount) and amount >= 0 else None


def _timings(value: Any) -> dict[str, float]:
    if not is_mapping(value):
        return {}
    out: dict[str, float] = {}
    for key, item in value.items():
        if isinstance(key, str) and not isinstance(item, bool) and isinstance(item, int | float):
            number = float(item)
            if math.isfinite(number):
                out[key] = number
    return out
