"""Fixtures of the Messages API end-to-end tests: strict ``anthropic`` SDK clients of a server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import pytest
from aiohttp.test_utils import TestServer

from tests.messages.agents import sdk_client

Clients = Callable[..., anthropic.AsyncAnthropic]


@pytest.fixture
async def clients() -> AsyncIterator[Clients]:
    """``clients(server, key=..., **kwargs)``: a strict ``anthropic`` SDK client of a TestServer,
    closed after the test."""
    made: list[anthropic.AsyncAnthropic] = []

    def make(server: TestServer, key: str = "sk-ant-test", **kwargs: Any) -> anthropic.AsyncAnthropic:
        client = sdk_client(str(server.make_url("")), key, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        await client.close()
