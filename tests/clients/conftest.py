"""Fixtures for the real-client tests: the clients (skipped when absent) and the upstreams they talk to."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.clients.capture import CaptureState, running_capture
from tests.clients.codex import find_codex

AGENTS_REQUIREMENT = "openai-agents==0.24.0"


@pytest.fixture
def codex_bin() -> Path:
    """The Codex CLI launcher; skips the test when it is not installed."""
    path = find_codex()
    if path is None:
        pytest.skip("@openai/codex not installed: run .ci/install/codex.sh")
    return path


@pytest.fixture
def agents_sdk() -> None:
    """Skips the test when openai-agents is not installed."""
    if importlib.util.find_spec("agents") is None:
        pytest.skip(f"openai-agents not installed: .venv/bin/pip install '{AGENTS_REQUIREMENT}'")


@dataclass(frozen=True)
class Upstream:
    """A running upstream: its base URL (ending in ``/v1``)."""

    base_url: str

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    async def received(self) -> list[dict[str, Any]]:
        """``GET /sim/requests``: the requests the reference upstream received, oldest first."""
        async with aiohttp.ClientSession() as session, session.get(f"{self.root}/sim/requests") as response:
            assert response.status == 200, await response.text()
            entries: list[dict[str, Any]] = await response.json()
            return entries


@pytest.fixture
async def sim_upstream() -> AsyncIterator[Upstream]:
    """The reference upstream (``proxy.sim``) on a real loopback socket."""
    from proxy.sim.server import running_sim

    async with running_sim() as url:
        yield Upstream(url)


@pytest.fixture
async def capture() -> AsyncIterator[tuple[str, CaptureState]]:
    """The scripted capture upstream (:mod:`tests.clients.capture`): ``(base URL, state)``."""
    async with running_capture() as pair:
        yield pair
