"""The price table (name resolution, validation of a parsed table) and the cost arithmetic.

The core takes the parsed table and does no I/O; reading the shipped table or
``metrics.prices_file`` and turning a bad entry into a ConfigError is the config layer's
(tests/test_prices.py)."""

from __future__ import annotations

import ast
import datetime as dt
import math
import tomllib

import pytest

from proxy import native
from proxy.config import MetricsSettings
from proxy.core import pricing
from proxy.core.errors import InvalidSetting
from proxy.core.pricing import Cost, Price, PriceTable, cost_of
from proxy.core.usage import Usage


@pytest.fixture(scope="module")
def table() -> PriceTable:
    """The shipped table, as kvwarm reads it with no ``metrics.prices_file``."""
    return MetricsSettings().prices()


def usage(
    prompt: int | None,
    completion: int | None,
    cached: int | None = None,
    write: int | None = None,
    reasoning: int | None = None,
    billed: float | None = None,
) -> Usage:
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        cache_write_tokens=write,
        reasoning_tokens=reasoning,
        billed_usd=billed,
    )


GPT_4O = Price(input=2.5, cached_input=1.25, output=10.0)
SONNET = Price(input=3.0, cached_input=0.3, cache_write=3.75, cache_write_1h=6.0, output=15.0)


def test_shipped_table_has_the_reference_upstream_and_common_models(table: PriceTable) -> None:
    assert table.lookup("kvwarm-sim") == Price(input=2.5, cached_input=1.25, output=10.0)
    assert table.lookup("gpt-4o") == GPT_4O
    assert table.lookup("claude-3-5-sonnet") == SONNET
    for model in (
        "gpt-4o-mini",
        "gpt-4.1",
        "gpt-4.1-mini",
        "o3",
        "o4-mini",
        "gpt-5",
        "deepseek-chat",
        "deepseek-reasoner",
        "claude-3-5-haiku",
        "claude-3-7-sonnet",
        "claude-sonnet-4",
        "claude-opus-4",
        "gemini-2.5-pro",
        "gemini-2.0-flash",
    ):
        assert table.lookup(model) is not None, model
    assert isinstance(table.as_of, dt.date)


def test_shipped_prices_are_coherent(table: PriceTable) -> None:
    # Cache reads are never dearer than input, outputs never cheaper than nothing.
    assert len(table.models) >= 40
    for name, price in table.models.items():
        assert price.input > 0 and price.output > 0, name
        assert price.cached_input is None or price.cached_input <= price.input, name
        for ttl in ("5m", "30m", "1h", "12h", "unknown"):
            assert price.write_rate(ttl) >= price.input, (name, ttl)


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("gpt-4o-2024-08-06", "gpt-4o"),  # OpenAI date suffix
        ("gpt-4o-mini-2024-07-18", "gpt-4o-mini"),
        ("openai/gpt-4o", "gpt-4o"),  # provider prefix
        ("openrouter/openai/gpt-4.1-mini", "gpt-4.1-mini"),  # two prefixes
        ("claude-3-5-sonnet-20241022", "claude-3-5-sonnet"),  # Anthropic date
        ("claude-3-5-sonnet-latest", "claude-3-5-sonnet"),
        ("claude-3-5-sonnet@20240620", "claude-3-5-sonnet"),  # Vertex AI
        ("anthropic/claude-3.5-sonnet", "claude-3-5-sonnet"),  # prefix + alias
        ("anthropic/claude-3.7-sonnet:thinking", "claude-3-7-sonnet"),  # prefix + alias + tag
        ("claude-sonnet-4-20250514", "claude-sonnet-4"),
        ("o3-mini-2025-01-31", "o3-mini"),
        ("gpt-3.5-turbo-0125", "gpt-3.5-turbo"),
        ("gpt-5-chat-latest", "gpt-5"),  # -latest, then alias
        ("gemini-2.5-pro-preview-05-06", "gemini-2.5-pro"),
        ("google/gemini-2.5-flash-preview-09-2025", "gemini-2.5-flash"),
        ("deepseek/deepseek-chat", "deepseek-chat"),
        ("meta-llama/Llama-3.3-70B-Instruct-Turbo", "llama-3.3-70b-instruct-turbo"),  # letter case
        ("GPT-4o", "gpt-4o"),
    ],
)
def test_lookup_resolves_spellings(table: PriceTable, model: str, expected: str) -> None:
    price = table.lookup(expected)
    assert price is not None
    assert table.lookup(model) == price


def test_exact_snapshot_entry_wins_over_suffix_stripping(table: PriceTable) -> None:
    launch = table.lookup("gpt-4o-2024-05-13")
    assert launch == Price(input=5.0, output=15.0)
    assert launch != table.lookup("gpt-4o")


def test_unknown_models_are_unpriced_and_free_tags_cost_nothing(table: PriceTable) -> None:
    assert table.lookup("my-finetune-7b") is None
    assert table.lookup("") is None
    assert table.lookup("   ") is None
    assert table.lookup("openai/") is None
    free = table.lookup("meta-llama/llama-3.3-8b-instruct:free")
    assert free is not None and (free.input, free.output, free.read_rate()) == (0.0, 0.0, 0.0)
    assert all(free.write_rate(ttl) == 0.0 for ttl in ("5m", "1h", "12h"))
    assert "gpt-4o" in table and "my-finetune-7b" not in table


def test_cost_openai_hand_computed() -> None:
    # 2006 prompt (1920 cached), 300 completion (64 of them reasoning) on gpt-4o:
    # 86 * 2.5 + 1920 * 1.25 + 300 * 10 = 215 + 2400 + 3000 = 5615 per million.
    cost = cost_of(usage(2006, 300, cached=1920, reasoning=64), GPT_4O)
    assert cost.billed is False
    assert cost.usd == pytest.approx(0.005615, abs=1e-12)


def test_cost_anthropic_cache_reads_and_writes() -> None:
    # prompt 10298 = 50 uncached + 10000 read + 248 written; 503 output.
    # 50*3 + 10000*0.3 + 248*3.75 + 503*15 = 150 + 3000 + 930 + 7545 = 11625 per million.
    cost = cost_of(usage(10298, 503, cached=10000, write=248), SONNET)
    assert cost.usd == pytest.approx(0.011625, abs=1e-12)


def test_reads_fall_back_to_the_input_rate_and_writes_to_their_multiplier() -> None:
    flat = Price(input=1.0, output=2.0)
    # Reads at 1.0, writes of unknown TTL at the 1.25 default: 50 * 1 + 900 * 1 + 50 * 1.25 + 10 * 2
    # = 1032.5 per million.
    assert cost_of(usage(1000, 10, cached=900, write=50), flat).usd == pytest.approx(0.0010325)


def test_unknown_cached_count_bills_the_whole_prompt_as_uncached() -> None:
    # 2006 * 2.5 + 300 * 10 = 5015 + 3000 = 8015 per million.
    assert cost_of(usage(2006, 300), GPT_4O).usd == pytest.approx(0.008015)


def test_billed_amount_wins() -> None:
    billed = cost_of(usage(2006, 300, cached=1920, billed=0.0045), GPT_4O)
    assert (billed.usd, billed.billed) == (0.0045, True)
    assert cost_of(usage(None, None, billed=0.0), None) == Cost(usd=0.0, billed=True)


def test_unpriced_is_none_never_zero() -> None:
    assert cost_of(usage(2006, 300), None) == Cost(usd=None, billed=False)
    assert cost_of(usage(None, None, cached=5), GPT_4O) == Cost(usd=None, billed=False)


def test_one_missing_count_is_taken_as_zero() -> None:
    assert cost_of(usage(None, 100), GPT_4O).usd == pytest.approx(0.001)
    assert cost_of(usage(400, None), GPT_4O).usd == pytest.approx(0.001)


def test_inconsistent_counts_never_go_negative() -> None:
    cost = cost_of(usage(100, 0, cached=150, write=80), SONNET)
    assert cost.usd == pytest.approx(100 * 0.3 / 1e6)


def parsed(text: str) -> PriceTable:
    return PriceTable.from_mapping(tomllib.loads(text))


def test_a_small_table() -> None:
    table = parsed(
        'as_of = 2025-01-02\n[aliases]\n"fast" = "m1"\n'
        '[models."m1"]\ninput = 1\ncached_input = 0.1\ncache_write = 1.25\noutput = 4\n',
    )
    assert table.lookup("fast") == Price(input=1.0, cached_input=0.1, cache_write=1.25, output=4.0)
    assert table.lookup("m1-20250101") == table.lookup("fast")
    assert table.as_of == dt.date(2025, 1, 2)
    assert len(table) == 1


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[models."gpt-x"]\ninput = "2.5"\noutput = 1\n', "prices.gpt-x.input"),
        ('[models."gpt-x"]\ninput = -1\noutput = 1\n', "prices.gpt-x.input"),
        ('[models."gpt-x"]\ninput = true\noutput = 1\n', "prices.gpt-x.input"),
        ('[models."gpt-x"]\ninput = nan\noutput = 1\n', "prices.gpt-x.input"),
        ('[models."gpt-x"]\ninput = 1\n', "prices.gpt-x.output"),
        ('[models."gpt-x"]\ninput = 1\noutput = 1\ncached = 0.5\n', "prices.gpt-x.cached"),
        ('[models]\n"gpt-x" = 3\n', "prices.gpt-x"),
        ('[models."gpt-x"]\ninput = 1\noutput = 1\n[aliases]\n"y" = "nope"\n', "prices.aliases.y"),
        ('[aliases]\n"y" = 3\n', "prices.aliases.y"),
        ("[currency]\nname = 'EUR'\n", "prices.currency"),
        ("models = 3\n", "prices.models"),
        ("as_of = 'yesterday'\n", "prices.as_of"),
    ],
)
def test_bad_entries_name_their_key(text: str, key: str) -> None:
    """The core's own error, a plain ValueError naming the key; the config layer turns it into
    a ConfigError (tests/test_prices.py)."""
    with pytest.raises(InvalidSetting) as info:
        parsed(text)
    assert info.value.key == key
    assert type(info.value) is InvalidSetting and isinstance(info.value, ValueError)


def test_cost_is_finite_for_large_counts(table: PriceTable) -> None:
    price = table.lookup("claude-opus-4")
    cost = cost_of(usage(10**9, 10**8, cached=5 * 10**8, write=10**8), price)
    assert cost.usd is not None and math.isfinite(cost.usd)
    # 4e8 * 15 + 5e8 * 1.5 + 1e8 * 18.75 + 1e8 * 75 = 6000 + 750 + 1875 + 7500 USD
    assert cost.usd == pytest.approx(16125.0)


def test_pricing_does_no_io_and_imports_nothing_outside_the_core() -> None:
    """The core takes the parsed table (proxy/config.py reads the file): no file, path or TOML
    reading here, and no kvwarm error but the core's own (proxy/core/errors.py)."""
    tree = ast.parse(native.source(pricing.__name__).read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id != "open", f"line {node.lineno}: the core opens no file"
    assert imported <= {"__future__", "datetime", "math", "re", "collections.abc", "dataclasses", "types",
                        "typing", "mypy_extensions", ".errors", ".usage"}, imported


# -- cache writes and what the cache saved -------------------------------------------------------

TERRA = Price(input=2.5, cached_input=0.25, cache_write=3.125, cache_write_12h=3.125, output=15.0)


def test_the_shipped_table_prices_current_models_and_their_writes(table: PriceTable) -> None:
    assert table.as_of == dt.date(2026, 11, 27)
    for model, (read, write_5m, write_1h) in {
        "anthropic/claude-sonnet-4.6": (0.3, 3.75, 6.0),  # OpenRouter's spelling
        "claude-opus-4-8": (0.5, 6.25, 10.0),
        "claude-haiku-4-5-20251001": (0.1, 1.25, 2.0),
    }.items():
        price = table.lookup(model)
        assert price is not None, model
        assert (price.read_rate(), price.write_rate("5m"), price.write_rate("1h")) == (read, write_5m, write_1h), model
    for model in ("gpt-5.6-sol", "openai/gpt-5.6-terra", "gpt-5.6-luna"):
        price = table.lookup(model)
        assert price is not None, model
        assert price.write_rate("30m") == price.write_rate("12h") == pytest.approx(1.25 * price.input), model
        assert price.read_rate() == pytest.approx(0.1 * price.input), model
    for model in ("gpt-5.5", "gpt-5.4-mini", "deepseek-v4-pro", "deepseek/deepseek-v4-flash", "qwen/qwen3-max",
                  "qwen-plus", "gemini-2.5-pro"):
        assert table.lookup(model) is not None, model


def test_each_ttl_pays_its_own_write_price() -> None:
    # 10000 prompt = 1000 uncached + 5000 read + 3000 written for 5 minutes + 1000 for an hour; 500 output.
    # 1000*3 + 5000*0.3 + 3000*3.75 + 1000*6 + 500*15 = 3000 + 1500 + 11250 + 6000 + 7500 = 29250 per million.
    u = Usage(prompt_tokens=10000, completion_tokens=500, cached_tokens=5000, cache_write_tokens=4000,
              cache_write_5m_tokens=3000, cache_write_1h_tokens=1000)
    assert cost_of(u, SONNET).usd == pytest.approx(0.02925, abs=1e-12)


def test_openai_30_minute_and_12_hour_writes() -> None:
    # 9000 prompt = 500 uncached + 6000 read + 2000 (30 min) + 500 (12 h) written; 120 output.
    # 500*2.5 + 6000*0.25 + 2500*3.125 + 120*15 = 1250 + 1500 + 7812.5 + 1800 = 12362.5 per million.
    u = Usage(prompt_tokens=9000, completion_tokens=120, cached_tokens=6000, cache_write_tokens=2500,
              cache_write_30m_tokens=2000, cache_write_12h_tokens=500)
    cost = cost_of(u, TERRA)
    assert cost.usd == pytest.approx(0.0123625, abs=1e-12)
    # Saved: 6000 * (2.5 - 0.25) = 13500; premium: 2500 * (3.125 - 2.5) = 1562.5 per million.
    assert cost.read_saving_usd == pytest.approx(0.0135, abs=1e-12)
    assert cost.write_premium_usd == pytest.approx(0.0015625, abs=1e-12)
    assert cost.cache_saving_usd == pytest.approx(0.0119375, abs=1e-12)
    # The saving is exactly the uncached price of the prompt minus what the prompt cost.
    uncached = cost_of(Usage(prompt_tokens=9000, completion_tokens=120), TERRA).usd
    assert uncached is not None and cost.usd is not None
    assert cost.cache_saving_usd == pytest.approx(uncached - cost.usd, abs=1e-12)


def test_default_write_multipliers() -> None:
    bare = Price(input=4.0, output=8.0)
    assert [bare.write_rate(t) for t in ("5m", "30m", "unknown", "1h", "12h")] == [5.0, 5.0, 5.0, 8.0, 5.0]
    # 1000 written for an hour at 2 x 4.0 = 8000 per million; 1000 for 5 minutes at 1.25 x = 5000.
    u = Usage(prompt_tokens=2000, completion_tokens=0, cached_tokens=0, cache_write_tokens=2000,
              cache_write_5m_tokens=1000, cache_write_1h_tokens=1000)
    assert cost_of(u, bare).usd == pytest.approx(0.013)


def test_writes_not_repaid_make_the_saving_negative() -> None:
    # A first turn writes its whole 4000-token prefix for an hour and reads nothing.
    # Premium: 4000 * (6 - 3) = 12000 per million; nothing saved.
    first = cost_of(Usage(prompt_tokens=4100, completion_tokens=10, cached_tokens=0, cache_write_tokens=4000,
                          cache_write_1h_tokens=4000), SONNET)
    assert (first.read_saving_usd, first.write_premium_usd) == (0.0, pytest.approx(0.012))
    assert first.cache_saving_usd == pytest.approx(-0.012)
    # The second turn reads it: 4000 * (3 - 0.3) = 10800 per million, not yet enough.
    second = cost_of(Usage(prompt_tokens=4200, completion_tokens=10, cached_tokens=4000, cache_write_tokens=0), SONNET)
    assert second.cache_saving_usd == pytest.approx(0.0108)
    assert first.cache_saving_usd + second.cache_saving_usd == pytest.approx(-0.0012)


def test_savings_are_unknown_where_the_counts_or_the_price_are() -> None:
    unknown = cost_of(usage(2006, 300), GPT_4O)
    assert (unknown.read_saving_usd, unknown.write_premium_usd, unknown.cache_saving_usd) == (None, None, None)
    reads_only = cost_of(usage(2006, 300, cached=1920), GPT_4O)
    assert reads_only.write_premium_usd is None  # no write count reported: no premium known
    assert reads_only.cache_saving_usd == reads_only.read_saving_usd == pytest.approx(1920 * 1.25e-6)
    assert reads_only.saving_per_cached_token == pytest.approx(1.25e-6)
    unpriced = cost_of(usage(2006, 300, cached=1920, write=50), None)
    assert (unpriced.cache_saving_usd, unpriced.saving_per_cached_token) == (None, 0.0)


def test_a_provider_bill_keeps_the_list_price_savings() -> None:
    cost = cost_of(usage(10298, 503, cached=10000, write=248, billed=0.0123), SONNET)
    assert (cost.usd, cost.billed) == (0.0123, True)
    # 10000 * 2.7 - 248 * 0.75 = 27000 - 186 = 26814 per million.
    assert cost.cache_saving_usd == pytest.approx(0.026814)


def test_write_counts_above_the_prompt_are_clipped_in_ttl_order() -> None:
    # 1000 prompt, 600 read: only 400 can have been written, the 5-minute ones first.
    u = Usage(prompt_tokens=1000, completion_tokens=0, cached_tokens=600, cache_write_tokens=900,
              cache_write_5m_tokens=300, cache_write_1h_tokens=600)
    # 600*0.3 + 300*3.75 + 100*6 = 180 + 1125 + 600 = 1905 per million.
    assert cost_of(u, SONNET).usd == pytest.approx(0.001905)


def test_write_multipliers_in_the_table() -> None:
    table = parsed(
        '[models."m"]\ninput = 2\noutput = 8\ncache_write_multiplier = 1.5\ncache_write_1h_multiplier = 3\n'
        'cache_write_12h = 2.5\n'
    )
    price = table.lookup("m")
    assert price == Price(input=2.0, output=8.0, cache_write=3.0, cache_write_1h=6.0, cache_write_12h=2.5)


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ('[models."m"]\ninput = 1\noutput = 1\ncache_write = 1.25\ncache_write_multiplier = 1.25\n',
         "prices.m.cache_write_multiplier", "not both"),
        ('[models."m"]\ninput = 1\noutput = 1\ncache_write_1h_multiplier = -2\n',
         "prices.m.cache_write_1h_multiplier", ">= 0"),
        ('[models."m"]\ninput = 1\noutput = 1\ncache_write_12h = "1.25x"\n', "prices.m.cache_write_12h", "a number"),
        ('[models."m"]\ninput = 1\noutput = 1\ncache_write_24h = 2\n', "prices.m.cache_write_24h", "unknown field"),
    ],
)
def test_bad_write_prices_name_their_key(text: str, key: str, fragment: str) -> None:
    with pytest.raises(InvalidSetting) as info:
        parsed(text)
    assert info.value.key == key and fragment in info.value.problem
