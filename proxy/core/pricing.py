"""Cost of a response, and what the provider's prompt cache saved on it: from the provider's
bill when it sends one, else from a price table.

The table is parsed TOML of USD per million tokens (the shipped one is
``proxy/defaults/prices.toml``; :meth:`proxy.config.MetricsSettings.prices` reads it, or the
file ``metrics.prices_file`` names, and hands the parsed mapping to
:meth:`PriceTable.from_mapping`)::

    [models."claude-sonnet-4-6"]
    input = 3.0            # uncached prompt tokens
    cached_input = 0.3     # prompt tokens read from the cache (absent: billed as input)
    cache_write = 3.75     # written for 5 or 30 minutes, or for a TTL not reported
    cache_write_1h = 6.0   # written for an hour
    output = 15.0          # completion tokens, reasoning included

    [models."gpt-5.6-terra"]
    input = 2.5
    cached_input = 0.25
    cache_write_12h_multiplier = 1.25   # a write price as a multiple of input instead
    output = 15.0

    [aliases]
    "claude-sonnet-4.6" = "claude-sonnet-4-6"

Each write price (``cache_write``, ``cache_write_1h``, ``cache_write_12h``) may be given as a
price or as a multiple of ``input`` (``<name>_multiplier``), not both; absent, it is
:data:`DEFAULT_WRITE_MULTIPLIERS` times ``input`` (1.25 for 5 and 30 minutes and 12 hours, 2 for
an hour). Multipliers are resolved when the table is read: a :class:`Price` holds prices only.

:meth:`PriceTable.lookup` resolves a model name the way providers spell it:
exact name, then aliases, then case-insensitively, then without a provider
prefix (``openai/gpt-4o``, ``openrouter/anthropic/...``), a ``:tag``
(``:beta``, ``:thinking``; ``:free`` costs nothing) and date or version
suffixes (``gpt-4o-2024-08-06``, ``claude-3-5-sonnet-20241022``, ``-latest``,
``@20240620``, ``-0125``, ``-preview-05-06``, ``-preview-09-2025``). An unknown model is *unpriced*:
its cost is ``None``, never zero.

What the cache saved (:attr:`Cost.cache_saving_usd`) is what the same prompt tokens would have
cost uncached, minus what they cost: the reads' discount against ``input`` less the writes'
premium over it. It is negative when writes were not repaid by reads, and it is worked out
from the list prices even when the provider bills (the bill does not say how it splits).

Like the rest of the core this module does no I/O and knows no kvwarm error: a bad entry
raises :class:`~proxy.core.errors.InvalidSetting` naming its key (``prices.<model>.<field>``),
which the config layer turns into a ``ConfigError``.
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from mypy_extensions import mypyc_attr

from .errors import InvalidSetting
from .usage import Usage

__all__ = ["DEFAULT_WRITE_MULTIPLIERS", "Cost", "Price", "PriceTable", "cost_of"]

_PER_TOKEN = 1e-6
WRITE_PRICES: Final = ("cache_write", "cache_write_1h", "cache_write_12h")
"""The write price fields of a model; each may instead be given as ``<field>_multiplier``."""
_SHORT_WRITE: Final = 1.25
_LONG_WRITE: Final = 2.0
DEFAULT_WRITE_MULTIPLIERS: Final[Mapping[str, float]] = MappingProxyType(
    {"cache_write": _SHORT_WRITE, "cache_write_1h": _LONG_WRITE, "cache_write_12h": _SHORT_WRITE}
)
"""A write price not in the table, as a multiple of ``input``: Anthropic bills 5-minute writes at
1.25x and one-hour writes at 2x, OpenAI (GPT-5.6) its writes at 1.25x."""
_PRICES = ("input", "cached_input", *WRITE_PRICES, "output")
_FIELDS = (*_PRICES, *(f"{name}_multiplier" for name in WRITE_PRICES))
_REQUIRED = ("input", "output")

# Tried in order, repeatedly, each on what the previous left.
_SUFFIXES = tuple(
    re.compile(pattern)
    for pattern in (
        r"-latest$",
        r"@[^@]*$",  # Vertex AI: claude-3-5-sonnet@20240620
        r"-\d{4}-\d{2}-\d{2}$",  # OpenAI snapshots: gpt-4o-2024-08-06
        r"-\d{8}$",  # Anthropic snapshots: claude-3-5-sonnet-20241022
        r"-\d{2}-\d{4}$",  # gemini-2.5-flash-preview-09-2025
        r"-\d{4}$",  # gpt-3.5-turbo-0125, mistral-large-2411
        r"-\d{2}-\d{2}$",  # gemini-2.5-pro-preview-05-06
        r"-preview$",
    )
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Price:
    """List price of one model, USD per million tokens."""

    input: float
    output: float
    cached_input: float | None = None
    """Cache reads; ``None`` = billed as ``input``."""
    cache_write: float | None = None
    """Cache writes for 5 minutes (Anthropic), 30 minutes (OpenAI) or a TTL not reported;
    ``None`` = 1.25 x ``input``."""
    cache_write_1h: float | None = None
    """Cache writes for an hour (Anthropic); ``None`` = 2 x ``input``."""
    cache_write_12h: float | None = None
    """Cache writes for 12 hours (OpenAI); ``None`` = 1.25 x ``input``."""

    def read_rate(self) -> float:
        """USD per million cached tokens read."""
        return self.input if self.cached_input is None else self.cached_input

    def write_rate(self, ttl: str) -> float:
        """USD per million tokens written for ``ttl`` (a :data:`~proxy.core.usage.WRITE_TTLS`
        bucket, or :data:`~proxy.core.usage.UNKNOWN_TTL`: priced as the shortest TTL)."""
        if ttl == "1h":
            return _LONG_WRITE * self.input if self.cache_write_1h is None else self.cache_write_1h
        if ttl == "12h":
            return _SHORT_WRITE * self.input if self.cache_write_12h is None else self.cache_write_12h
        return _SHORT_WRITE * self.input if self.cache_write is None else self.cache_write


_FREE = Price(input=0.0, output=0.0, cached_input=0.0, cache_write=0.0, cache_write_1h=0.0, cache_write_12h=0.0)


@dataclass(init=False, unsafe_hash=True)  # built for every response (proxy/core/values.py)
class Cost:
    """What one response cost, and what the provider's prompt cache saved on it."""

    usd: Final[float | None]
    """``None`` = unpriced (unknown model, or no token counts); never 0 for unknown."""
    billed: Final[bool]
    """True when taken from the provider's billing block rather than estimated."""
    read_saving_usd: Final[float | None]
    """What the cache reads saved against the input price: cached tokens x (input - cached
    price). ``None``: no price, or the cached count is unknown."""
    write_premium_usd: Final[float | None]
    """What the cache writes cost above the input price: written tokens x (write - input price),
    each TTL at its own price. ``None``: no price, or the provider reported no write count."""
    saving_per_cached_token: Final[float]
    """USD one cached token saved at this model's prices (0 when unpriced): a part of the cached
    tokens (those a repair rescued) saved that many times this."""

    def __init__(
        self,
        *,
        usd: float | None,
        billed: bool,
        read_saving_usd: float | None = None,
        write_premium_usd: float | None = None,
        saving_per_cached_token: float = 0.0,
    ) -> None:
        self.usd = usd
        self.billed = billed
        self.read_saving_usd = read_saving_usd
        self.write_premium_usd = write_premium_usd
        self.saving_per_cached_token = saving_per_cached_token

    @property
    def cache_saving_usd(self) -> float | None:
        """What the same prompt tokens would have cost uncached, minus what they cost (reads
        and writes at their prices): negative when the writes were not repaid. ``None`` when
        neither part is known."""
        if self.read_saving_usd is None and self.write_premium_usd is None:
            return None
        return (self.read_saving_usd or 0.0) - (self.write_premium_usd or 0.0)


@mypyc_attr(allow_interpreted_subclasses=True)  # the tests subclass it (proxy/native.py)
class PriceTable:
    """Model name -> :class:`Price`, with aliases and forgiving name resolution."""

    __slots__ = ("_aliases", "_folded", "_models", "as_of")

    def __init__(
        self,
        models: Mapping[str, Price],
        aliases: Mapping[str, str] | None = None,
        as_of: _dt.date | None = None,
    ) -> None:
        self._models = dict(models)
        self._aliases = dict(aliases or {})
        for name, target in self._aliases.items():
            if target not in self._models:
                raise InvalidSetting(f"prices.aliases.{name}", f"unknown model {target!r}")
        # Case-insensitive fallback; exact spellings above are tried first.
        self._folded: dict[str, Price] = {}
        for name, target in self._aliases.items():
            self._folded.setdefault(name.lower(), self._models[target])
        for name, price in self._models.items():
            self._folded[name.lower()] = price
        self.as_of = as_of
        """The date the prices were taken from the providers (``as_of`` in the file)."""

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> PriceTable:
        """Build from parsed TOML (``models``, ``aliases``, optional ``as_of``); a bad entry
        raises :class:`~proxy.core.errors.InvalidSetting` naming its key."""
        for key in data:
            if key not in ("models", "aliases", "as_of"):
                raise InvalidSetting(f"prices.{key}", "unknown key (expected models, aliases, as_of)")
        models_raw = data.get("models", {})
        if not isinstance(models_raw, Mapping):
            raise InvalidSetting("prices.models", "must be a table of models")
        models = {name: _price(name, entry) for name, entry in models_raw.items()}
        aliases_raw = data.get("aliases", {})
        if not isinstance(aliases_raw, Mapping):
            raise InvalidSetting("prices.aliases", "must be a table of name = model")
        aliases: dict[str, str] = {}
        for name, target in aliases_raw.items():
            if not isinstance(target, str):
                raise InvalidSetting(f"prices.aliases.{name}", "must be a model name (a string)")
            aliases[name] = target
        as_of = data.get("as_of")
        if as_of is not None and not isinstance(as_of, _dt.date):
            raise InvalidSetting("prices.as_of", "must be a date (YYYY-MM-DD)")
        return cls(models, aliases, as_of)

    @property
    def models(self) -> Mapping[str, Price]:
        """The priced models by their table name (read-only)."""
        return MappingProxyType(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def __contains__(self, model: object) -> bool:
        return isinstance(model, str) and self.lookup(model) is not None

    def lookup(self, model: str) -> Price | None:
        """The price of ``model``, resolving aliases, prefixes and suffixes; None = unpriced."""
        if not isinstance(model, str):
            return None
        for candidate in _candidates(model.strip()):
            if candidate is _FREE_MARK:
                return _FREE
            price = self._get(candidate)
            if price is not None:
                return price
        return None

    def _get(self, name: str) -> Price | None:
        price = self._models.get(name)
        if price is not None:
            return price
        target = self._aliases.get(name)
        if target is not None:
            return self._models[target]
        return self._folded.get(name.lower())


_FREE_MARK = "\x00free"


def _candidates(name: str) -> Iterator[str]:
    """Spellings of ``name`` to try, most specific first."""
    if not name:
        return
    yield name
    # Provider prefixes: "openrouter/anthropic/claude-3.5-sonnet" -> "anthropic/..." -> "claude-3.5-sonnet".
    variants = [name]
    rest = name
    while "/" in rest:
        rest = rest.split("/", 1)[1]
        if rest:
            variants.append(rest)
    for variant in variants:
        if variant is not name:
            yield variant
        base, colon, tag = variant.partition(":")
        if colon:
            if tag.lower() == "free":
                yield _FREE_MARK
                return
            if base:
                yield base
        current = base
        changed = True
        while changed:
            changed = False
            for suffix in _SUFFIXES:
                stripped = suffix.sub("", current)
                if stripped and stripped != current:
                    current = stripped
                    changed = True
                    yield current
                    break


def _price(model: str, entry: Any) -> Price:
    """One model's entry: prices checked, write multipliers resolved into prices."""
    if not isinstance(entry, Mapping):
        raise InvalidSetting(f"prices.{model}", "must be a table with input and output prices")
    for key in entry:
        if key not in _FIELDS:
            raise InvalidSetting(f"prices.{model}.{key}", f"unknown field (expected one of {', '.join(_FIELDS)})")
    for key in _REQUIRED:
        if key not in entry:
            raise InvalidSetting(f"prices.{model}.{key}", "missing (USD per million tokens)")
    values = {key: _number(model, key, entry.get(key)) for key in _FIELDS}
    input_price = values["input"]
    output_price = values["output"]
    assert input_price is not None and output_price is not None
    for name in WRITE_PRICES:
        multiplier = values[f"{name}_multiplier"]
        if multiplier is None:
            continue
        if values[name] is not None:
            raise InvalidSetting(
                f"prices.{model}.{name}_multiplier", f"give {name} (a price) or {name}_multiplier, not both"
            )
        values[name] = multiplier * input_price
    return Price(
        input=input_price,
        output=output_price,
        cached_input=values["cached_input"],
        cache_write=values["cache_write"],
        cache_write_1h=values["cache_write_1h"],
        cache_write_12h=values["cache_write_12h"],
    )


def _number(model: str, key: str, value: Any) -> float | None:
    """A price or multiplier of the table: a finite number >= 0, or absent (None)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidSetting(f"prices.{model}.{key}", f"must be a number, not {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise InvalidSetting(f"prices.{model}.{key}", f"must be a finite number >= 0, not {value!r}")
    return number


def cost_of(usage: Usage, price: Price | None) -> Cost:
    """The cost of one response, and what the cache saved on it.

    The provider's billed amount wins when present. Otherwise, with a price:
    uncached prompt tokens at ``input``, cached ones at the cached price, written ones at the
    write price of their TTL (:meth:`Price.write_rate`; a write of unreported TTL at the
    shortest's), completion tokens at ``output`` (reasoning tokens are part of them, not added
    again). An unknown cached count bills the whole prompt as uncached. A usage with neither a
    prompt nor a completion count is unpriced; one missing count of the two is taken as zero.
    Counts that do not add up are clipped: cached ones to the prompt, written ones to what
    the cache did not serve.

    The savings (:attr:`Cost.read_saving_usd`, :attr:`Cost.write_premium_usd`) are taken at the
    list price whenever there is one, billed or not.
    """
    billed = usage.billed_usd
    if price is None or (usage.prompt_tokens is None and usage.completion_tokens is None):
        return Cost(usd=billed, billed=billed is not None)
    prompt = usage.prompt_tokens or 0
    cached = min(usage.cached_tokens or 0, prompt)
    read_rate = price.read_rate()
    room = prompt - cached
    writes = 0.0  # USD per million
    premium = 0.0
    for ttl, count in usage.writes_by_ttl():
        written = min(count, room)
        room -= written
        rate = price.write_rate(ttl)
        writes += written * rate
        premium += written * (rate - price.input)
    # `room` is now the tokens neither read nor written: uncached.
    usd = billed
    if usd is None:
        usd = (room * price.input + cached * read_rate + writes + (usage.completion_tokens or 0) * price.output) * _PER_TOKEN
    saving_per_token = (price.input - read_rate) * _PER_TOKEN
    return Cost(
        usd=usd,
        billed=billed is not None,
        read_saving_usd=None if usage.cached_tokens is None else cached * saving_per_token,
        write_premium_usd=None if usage.cache_write_tokens is None else premium * _PER_TOKEN,
        saving_per_cached_token=saving_per_token,
    )
