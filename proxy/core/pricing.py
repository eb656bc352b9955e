"""Cost of a response: from the provider's bill when it sends one, else from a price table.

The table is parsed TOML of USD per million tokens (the shipped one is
``proxy/defaults/prices.toml``; :meth:`proxy.config.MetricsSettings.prices` reads it, or the
file ``metrics.prices_file`` names, and hands the parsed mapping to
:meth:`PriceTable.from_mapping`)::

    [models."gpt-4o"]
    input = 2.5          # uncached prompt tokens
    cached_input = 1.25  # prompt tokens read from the cache (absent: billed as input)
    cache_write = 3.0    # prompt tokens written to the cache (absent: billed as input)
    output = 10.0        # completion tokens, reasoning included

    [aliases]
    "gpt-4o-latest" = "gpt-4o"

:meth:`PriceTable.lookup` resolves a model name the way providers spell it:
exact name, then aliases, then case-insensitively, then without a provider
prefix (``openai/gpt-4o``, ``openrouter/anthropic/...``), a ``:tag``
(``:beta``, ``:thinking``; ``:free`` costs nothing) and date or version
suffixes (``gpt-4o-2024-08-06``, ``claude-3-5-sonnet-20241022``, ``-latest``,
``@20240620``, ``-0125``, ``-preview-05-06``, ``-preview-09-2025``). An unknown model is *unpriced*:
its cost is ``None``, never zero.

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

__all__ = ["Cost", "Price", "PriceTable", "cost_of"]

_FIELDS = ("input", "cached_input", "cache_write", "output")
_REQUIRED = ("input", "output")
_PER_TOKEN = 1e-6

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


@dataclass(frozen=True, slots=True)
class Price:
    """List price of one model, USD per million tokens."""

    input: float
    cached_input: float | None
    """Cache reads; ``None`` = billed as ``input``."""
    cache_write: float | None
    """Cache writes; ``None`` = billed as ``input``."""
    output: float


_FREE = Price(input=0.0, cached_input=0.0, cache_write=0.0, output=0.0)


@dataclass(init=False, unsafe_hash=True)  # a value class (proxy/core/values.py)
class Cost:
    """What one response cost."""

    usd: Final[float | None]
    """``None`` = unpriced (unknown model, or no token counts); never 0 for unknown."""
    billed: Final[bool]
    """True when taken from the provider's billing block rather than estimated."""

    def __init__(
        self,
        usd: float | None,
        billed: bool,
    ) -> None:
        self.usd = usd
        self.billed = billed

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
    if not isinstance(entry, Mapping):
        raise InvalidSetting(f"prices.{model}", "must be a table with input and output prices")
    for key in entry:
        if key not in _FIELDS:
            raise InvalidSetting(
                f"prices.{model}.{key}",
                "unknown field (expected input, cached_input, cache_write, output)",
            )
    for key in _REQUIRED:
        if key not in entry:
            raise InvalidSetting(f"prices.{model}.{key}", "missing (USD per million tokens)")
    values: dict[str, float | None] = {}
    for key in _FIELDS:
        value = entry.get(key)
        if value is None:
            values[key] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidSetting(f"prices.{model}.{key}", f"must be a number, not {value!r}")
        number = float(value)
        if not math.isfinite(number) or number < 0:
            raise InvalidSetting(
                f"prices.{model}.{key}", f"must be a finite number >= 0, not {value!r}"
            )
        values[key] = number
    input_price = values["input"]
    output_price = values["output"]
    assert input_price is not None and output_price is not None
    return Price(
        input=input_price,
        cached_input=values["cached_input"],
        cache_write=values["cache_write"],
        output=output_price,
    )


def cost_of(usage: Usage, price: Price | None) -> Cost:
    """The cost of one response.

    The provider's billed amount wins when present. Otherwise, with a price:
    uncached prompt tokens at ``input``, cached ones at ``cached_input``, cache
    writes at ``cache_write`` (each falling back to ``input``), completion
    tokens at ``output`` (reasoning tokens are part of them, not added again).
    An unknown cached count bills the whole prompt as uncached. A usage with
    neither a prompt nor a completion count is unpriced; one missing count of
    the two is taken as zero.
    """
    if usage.billed_usd is not None:
        return Cost(usd=usage.billed_usd, billed=True)
    if price is None or (usage.prompt_tokens is None and usage.completion_tokens is None):
        return Cost(usd=None, billed=False)
    prompt = usage.prompt_tokens or 0
    completion = usage.completion_tokens or 0
    cached = min(usage.cached_tokens or 0, prompt)
    written = min(usage.cache_write_tokens or 0, prompt - cached)
    uncached = prompt - cached - written
    cached_rate = price.input if price.cached_input is None else price.cached_input
    write_rate = price.input if price.cache_write is None else price.cache_write
    usd = (
        uncached * price.input
        + cached * cached_rate
        + written * write_rate
        + completion * price.output
    ) * _PER_TOKEN
    return Cost(usd=usd, billed=False)
