"""kvwarm as a user installs it: the wheel built from this checkout, installed with its declared
dependencies into a fresh virtualenv (no system site-packages, no path back to the checkout),
then ``kvwarm serve`` with no config file, from a directory that is not the checkout.

What this proves that the rest of the suite cannot (it runs the checkout, where files beside
the package are always there): the package finds its shipped defaults as package data
(``proxy/defaults/``, importlib.resources), the wheel holds what kvwarm needs, and the
dependencies pyproject.toml declares are enough to serve. Slow (a wheel build and an install):
``make test`` runs it, ``make test-fast`` does not.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

import proxy
from tests.test_serve import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "proxy")
"""What the wheel is built from: pyproject.toml, the readme it names, the package."""


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    home: Path
    """An empty working directory outside the checkout."""

    @property
    def kvwarm(self) -> Path:
        return self.venv / "bin" / "kvwarm"


def clean_env() -> dict[str, str]:
    """This environment without anything that would lead back to the checkout or its venv."""
    drop = {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("KVWARM_")}


def run(*args: str | Path, cwd: Path) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("packaging")
    src = root / "src"  # a copy: building in the checkout would leave build/ and *.egg-info there
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("*.so", "__pycache__", "_native.sha256"))
        else:
            shutil.copy2(REPO / name, src / name)
    dist = root / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", dist, src, cwd=root)
    (wheel,) = dist.glob("kvwarm-*.whl")
    venv = root / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=root)
    # This pip installs into the new environment (--python): the wheel and every dependency it
    # declares, resolved from the package index as a user's pip would.
    run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-compile", "--quiet", wheel, cwd=root)
    home = root / "home"
    home.mkdir()
    yield Installed(wheel=wheel, venv=venv, home=home)


def test_the_wheel_holds_the_package_and_its_defaults(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as whl:
        names = set(whl.namelist())
        entry_points = next(whl.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "proxy/defaults/prices.toml" in names
    assert "proxy/web/static/dashboard.js" in names and "proxy/py.typed" in names
    assert "kvwarm = proxy.cli:main" in entry_points
    assert {n.split("/")[0] for n in names} == {"proxy", f"kvwarm-{proxy.__version__}.dist-info"}
    assert not [n for n in names if n.endswith(".so")], "the wheel is plain Python"


def test_the_virtualenv_sees_nothing_of_the_checkout(installed: Installed) -> None:
    cfg = (installed.venv / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg
    where = run(installed.venv / "bin" / "python", "-c", "import proxy; print(proxy.__file__)", cwd=installed.home)
    assert Path(where.strip()).is_relative_to(installed.venv), where


def test_kvwarm_version_comes_from_the_installed_distribution(installed: Installed) -> None:
    assert run(installed.kvwarm, "--version", cwd=installed.home) == f"kvwarm {proxy.__version__}\n"


async def test_the_installed_kvwarm_serves_with_no_config_from_any_directory(installed: Installed, sim: TestServer) -> None:
    """``kvwarm serve`` on built-in defaults (no config file anywhere), a chat completion
    through it with the openai SDK, and its cost estimated from the price table in the wheel."""
    port = free_port()
    log = installed.home / "kvwarm.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            installed.kvwarm, "serve", "--port", str(port), "--store", "memory", "--upstream", str(sim.make_url("/v1")),
            cwd=installed.home, env=clean_env(), stdout=out, stderr=out,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        await ready(f"{base}/readyz", process, log)
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-packaging", max_retries=0) as client:
            reply = await client.chat.completions.create(
                model="kvwarm-sim", messages=[{"role": "user", "content": "hello from an installed kvwarm"}]
            )
        assert reply.choices[0].message.content and reply.usage is not None and reply.usage.prompt_tokens > 0
        async with aiohttp.ClientSession() as session, session.get(f"{base}/metrics") as r:
            exposition = await r.text()
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 30)
    assert code == 0, tail(log)
    estimated = sample(exposition, "kvwarm_cost_usd_total", model="kvwarm-sim", source="estimated")
    assert estimated is not None and estimated > 0, "the shipped price table prices the reference upstream's model"
    assert sorted(p.name for p in installed.home.iterdir()) == ["kvwarm.log"], "no config or store file written"


async def ready(url: str, process: asyncio.subprocess.Process, log: Path) -> None:
    """Wait until kvwarm answers ``/readyz`` (its first start imports every dependency afresh)."""
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            if process.returncode is not None:
                raise AssertionError(f"kvwarm exited with {process.returncode}:\n{tail(log)}")
            try:
                async with session.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"kvwarm did not become ready:\n{tail(log)}")


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def sample(exposition: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None
