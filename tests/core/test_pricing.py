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
    return Usage(prompt, completion, cached, write, reasoning, billed, "openai")


GPT_4O = Price(input=2.5, cached_input=1.25, cache_write=None, output=10.0)
SONNET = Price(input=3.0, cached_input=0.3, cache_write=3.75, output=15.0)


def test_shipped_table_has_the_reference_upstream_and_common_models(table: PriceTable) -> None:
    assert table.lookup("kvwarm-sim") == Price(2.5, 1.25, None, 10.0)
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
        assert price.cache_write is None or price.cache_write >= price.input, name


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
    assert launch == Price(5.0, None, None, 15.0)
    assert launch != table.lookup("gpt-4o")


def test_unknown_models_are_unpriced_and_free_tags_cost_nothing(table: PriceTable) -> None:
    assert table.lookup("my-finetune-7b") is None
    assert table.lookup("") is None
    assert table.lookup("   ") is None
    assert table.lookup("openai/") is None
    assert table.lookup("meta-llama/llama-3.3-8b-instruct:free") == Price(0.0, 0.0, 0.0, 0.0)
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


def test_cost_falls_back_to_input_rate_when_cache_rates_absent() -> None:
    flat = Price(input=1.0, cached_input=None, cache_write=None, output=2.0)
    # Everything prompt-side at 1.0: 1000 * 1 + 10 * 2 = 1020 per million.
    assert cost_of(usage(1000, 10, cached=900, write=50), flat).usd == pytest.approx(0.00102)


def test_unknown_cached_count_bills_the_whole_prompt_as_uncached() -> None:
    # 2006 * 2.5 + 300 * 10 = 5015 + 3000 = 8015 per million.
    assert cost_of(usage(2006, 300), GPT_4O).usd == pytest.approx(0.008015)


def test_billed_amount_wins() -> None:
    assert cost_of(usage(2006, 300, cached=1920, billed=0.0045), GPT_4O) == Cost(0.0045, True)
    assert cost_of(usage(None, None, billed=0.0), None) == Cost(0.0, True)


def test_unpriced_is_none_never_zero() -> None:
    assert cost_of(usage(2006, 300), None) == Cost(None, False)
    assert cost_of(usage(None, None, cached=5), GPT_4O) == Cost(None, False)


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
    assert table.lookup("fast") == Price(1.0, 0.1, 1.25, 4.0)
    assert table.lookup("m1-20250101") == Price(1.0, 0.1, 1.25, 4.0)
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
