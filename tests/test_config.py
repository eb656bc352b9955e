"""Settings: file, environment and flags; every bad value names its key."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import proxy
from proxy import cli
from proxy.config import Settings, load_settings
from proxy.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[1] / "config" / "kvwarm.toml"


def test_shipped_config_is_valid_and_matches_defaults() -> None:
    assert load_settings(EXAMPLE, env={}) == Settings()


def test_no_config_file_means_the_built_in_defaults(tmp_path: Path) -> None:
    """Without ``--config`` no file is read, not even a ``config/kvwarm.toml`` in the working
    directory or beside the package: an installed kvwarm starts anywhere on its defaults."""
    package = Path(proxy.__file__).parent
    shutil.copytree(package, tmp_path / "proxy", ignore=shutil.ignore_patterns("*.so", "__pycache__", "_native.sha256"))
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "kvwarm.toml").write_text("[server]\nport = 1\n")
    done = subprocess.run(
        [sys.executable, "-c", "from proxy.config import load_settings; print(load_settings(None, env={}).server.port)"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "8080\n"


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text('[server]\nport = 9001\nhost = "0.0.0.0"\n[upstream]\nbase_url = "http://a/v1"\n')
    s = load_settings(f, env={"KVWARM_SERVER_PORT": "9002", "KVWARM_UPSTREAM_BASE_URL": "http://b/v1"}, overrides={"server.port": 9003})
    assert (s.server.host, s.server.port, s.upstream.base_url) == ("0.0.0.0", 9003, ("http://b/v1",))


def test_env_bool_and_pin_patterns_json() -> None:
    s = load_settings(None, env={"KVWARM_REPAIR_ENABLED": "false", "KVWARM_REPAIR_PIN_PATTERNS": '{"system": ["\\\\d+"]}'})
    assert s.repair.enabled is False
    assert s.repair.pin_patterns == {"system": (r"\d+",)}


@pytest.mark.parametrize(
    ("toml", "key", "fragment"),
    [
        ("[server]\nport = 70000\n", "server.port", "0-65535"),
        ("[server]\nport = \"eighty\"\n", "server.port", "whole number"),
        ("[server]\nprot = 1\n", "server.prot", "unknown key"),
        ("[serv]\nport = 1\n", "serv", "unknown section"),
        ("[upstream]\nbase_url = \"ftp://x\"\n", "upstream.base_url", "http(s) URL"),
        ("[upstream]\nidle_timeout = -1\n", "upstream.idle_timeout", "positive"),
        ("[store]\nbackend = \"postgres://x\"\n", "store.backend", "memory"),
        ("[repair]\nenabled = \"maybe\"\n", "repair.enabled", "true or false"),
        ("[repair.pin_patterns]\nsystem = [\"(unclosed\"]\n", "repair.pin_patterns.system", "invalid regex"),
        ("[repair.pin_patterns]\nrobot = [\"x\"]\n", "repair.pin_patterns.robot", "unknown role"),
        ("[log]\nlevel = \"LOUD\"\n", "log.level", "one of"),
        ("[server\n", "config", "not valid TOML"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, toml: str, key: str, fragment: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_settings(f, env={})
    assert info.value.key == key
    assert fragment in str(info.value)


def test_bad_env_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^upstream\.connect_timeout: expected a number"):
        load_settings(None, env={"KVWARM_UPSTREAM_CONNECT_TIMEOUT": "soon"})


def test_cli_reports_config_error_without_traceback(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[server]\nport = -5\n")
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--config", str(f)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "kvwarm: config error: server.port: must be 0-65535, got -5"


def test_cli_help_documents_every_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "proxy", "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in ("--config", "--host", "--port", "--upstream", "--store"):
        assert flag in out
    out = subprocess.run([sys.executable, "-m", "proxy", "upstream-sim", "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in ("--host", "--port", "--cache", "--openhuman"):
        assert flag in out


def test_version_is_the_installed_distributions() -> None:
    out = subprocess.run([sys.executable, "-m", "proxy", "--version"], capture_output=True, text=True, timeout=60).stdout
    assert out == f"kvwarm {metadata.version('kvwarm')}\n"
    assert metadata.version("kvwarm") == proxy.__version__  # pyproject.toml reads proxy.__version__


def test_version_of_a_checkout_that_was_never_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert cli.version() == f"{proxy.__version__} (not installed)"
