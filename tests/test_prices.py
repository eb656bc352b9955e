"""The price table as the config layer reads it: shipped inside the package, replaced by
``metrics.prices_file``, and every problem a ConfigError naming the key and the file."""

from __future__ import annotations

import tomllib
from importlib.resources import files
from pathlib import Path

import pytest

from proxy.config import MetricsSettings, load_settings, parse_prices
from proxy.core.pricing import Price
from proxy.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
SHIPPED = files("proxy").joinpath("defaults", "prices.toml")
SMALL = '[models."m1"]\ninput = 1\noutput = 4\n'


def test_the_shipped_table_is_package_data() -> None:
    """No ``metrics.prices_file``: the table inside the package (importlib.resources), whatever
    the working directory; the same table as its bytes parsed."""
    assert SHIPPED.is_file()
    table = MetricsSettings().prices()
    assert dict(table.models) == dict(parse_prices(SHIPPED.read_bytes(), "x").models)
    assert table.lookup("kvwarm-sim") == Price(input=2.5, cached_input=1.25, output=10.0)


def test_the_price_data_has_one_home() -> None:
    """The shipped table is the only price table in the repository: config/ documents
    ``metrics.prices_file`` and holds no copy."""
    tables = [
        path.relative_to(REPO).as_posix()
        for top in ("config", "proxy", "docs", "grafana")
        for path in (REPO / top).rglob("*.toml")
        if "models" in tomllib.loads(path.read_text(encoding="utf-8"))
    ]
    assert tables == ["proxy/defaults/prices.toml"]
    example = tomllib.loads((REPO / "config" / "kvwarm.toml").read_text(encoding="utf-8"))
    assert example["metrics"]["prices_file"] == ""


@pytest.mark.parametrize("how", ["file", "environment"])
def test_a_prices_file_replaces_the_shipped_table_whole(tmp_path: Path, how: str) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(SMALL)
    if how == "file":
        config = tmp_path / "kvwarm.toml"
        config.write_text(f"[metrics]\nprices_file = {str(path)!r}\n")
        settings = load_settings(config, env={})
    else:
        settings = load_settings(None, env={"KVWARM_METRICS_PRICES_FILE": str(path)})
    table = settings.metrics.prices()
    assert table.lookup("m1") == Price(input=1.0, output=4.0)
    assert table.lookup("gpt-4o") is None and len(table) == 1


@pytest.mark.parametrize(
    ("content", "key", "fragment"),
    [
        (None, "metrics.prices_file", "cannot read"),
        (b"[models\n", "prices", "is not valid TOML"),
        (b"\xff\xfe[models]\n", "prices", "is not valid TOML"),
        (b'[models."gpt-x"]\ninput = "2.5"\noutput = 1\n', "prices.gpt-x.input", "must be a number"),
        (b'[models."gpt-x"]\ninput = 1\noutput = 1\n[aliases]\n"y" = "nope"\n', "prices.aliases.y", "unknown model"),
        (b'[models."gpt-x"]\ninput = 1\noutput = 1\ncache_write = 2\ncache_write_multiplier = 1.25\n',
         "prices.gpt-x.cache_write_multiplier", "not both"),
        (b'[models."gpt-x"]\ninput = 1\noutput = 1\ncache_write_1h_multiplier = inf\n',
         "prices.gpt-x.cache_write_1h_multiplier", "finite number"),
    ],
    ids=["missing", "toml", "encoding", "entry", "alias", "write-twice", "write-multiplier"],
)
def test_a_bad_prices_file_is_a_config_error_naming_the_key_and_the_file(
    tmp_path: Path, content: bytes | None, key: str, fragment: str
) -> None:
    path = tmp_path / "prices.toml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        MetricsSettings(prices_file=str(path)).prices()
    assert info.value.key == key
    assert fragment in info.value.problem and str(path) in info.value.problem
