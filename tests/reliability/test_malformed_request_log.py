"""A request aiohttp refuses while parsing (a huge header) is logged as one WARNING line.

Today aiohttp logs it at ERROR with a full traceback whose message quotes the offending header,
here a bearer key. kvwarm's logging setup (``proxy.cli.configure_logging``) turns that into one
WARNING line naming the client and the error class, without the header's bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from proxy.cli import configure_logging
from proxy.edge import defences as edge
from tests.reliability.conftest import exchange, get

KEY = "sk-live-" + "K" * 20_000


@pytest.fixture
def kvwarm_logging() -> Iterator[None]:
    configure_logging("INFO")
    yield
    server_log = logging.getLogger("aiohttp.server")
    for installed in [f for f in server_log.filters if isinstance(f, edge.MalformedRequestFilter)]:
        server_log.removeFilter(installed)


@pytest.mark.parametrize(
    "request_bytes",
    [
        get("/v1/models", extra=f"Authorization: Bearer {KEY}\r\n"),
        f"GET /v1/models?key={KEY} HTTP/1.1\r\nHost: kvwarm\r\n\r\n".encode(),
    ],
    ids=["huge-header", "huge-request-line"],
)
async def test_an_oversized_head_is_one_warning_line(
    kvwarm_logging: None, proxy: TestServer, caplog: Any, request_bytes: bytes
) -> None:
    caplog.set_level(logging.INFO)
    response = await exchange(proxy.port, request_bytes)
    assert response.status in (400, 431)
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(records) == 1, [r.getMessage() for r in records]
    (record,) = records
    assert record.levelno == logging.WARNING
    assert record.exc_info is None and not record.exc_text
    message = record.getMessage()
    assert "127.0.0.1" in message and "LineTooLong" in message
    assert "KKKK" not in message and "\n" not in message
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
