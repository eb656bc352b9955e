"""No request path leaves ``/v1/`` under ``upstream.base_url``.

kvwarm runs in front of a real upstream that records the raw path of every request it
receives; the base URL carries a path (``/base/v1``) so an escape would show as a path
outside it. Attacks are sent over raw sockets, byte for byte: percent-encoded and
double-encoded dot segments, encoded slashes and backslashes, NUL and other control
characters. Each must be answered 400 with an OpenAI-shaped body, and the upstream must
see nothing. Today's kvwarm forwards ``/v1/%2e%2e/%2e%2e/secret`` as ``/base/v1/../../secret``
and answers ``/v1/a%00b`` with a plain-text 500.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from tests.conftest import ProxyFactory
from tests.reliability.conftest import Recorder, exchange, get

ATTACKS = [
    "/v1/%2e%2e/%2e%2e/secret",
    "/v1/%2E%2E/%2E%2E/secret",
    "/v1/..%2f..%2fsecret",
    "/v1/../kvwarm/sessions",
    "/v1/../../secret",
    "/v1/./../secret",
    "/v1/models/..",
    "/v1/%2e/x",
    "/v1/%252e%252e/%252e%252e/secret",  # double-encoded: the upstream would decode it once more
    "/v1/%252E%252E%252Fsecret",
    "/v1/%25252e%25252e/secret",
    "/v1/a%2fb",
    "/v1/..%5c..%5csecret",
    "/v1/a\\..\\..\\secret",
    "/v1/a%5cb",
    "/v1/a%00b",
    "/v1/a%0d%0aX-Injected:%20yes",
    "/v1/a%09b",
    "/v1/a%7fb",
    "/v1/a%20HTTP/1.1",
    "/v1/a%3fadmin=1",
    "/v1/a%23frag",
    "/v1/caf%c3%a9",
]


@pytest.fixture
async def guarded(make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer]) -> tuple[Recorder, TestServer]:
    rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/base/v1")))
    return rec, proxy


@pytest.mark.parametrize("target", ATTACKS)
async def test_hostile_path_is_a_json_400_and_never_forwarded(guarded: tuple[Recorder, TestServer], target: str) -> None:
    rec, proxy = guarded
    response = await exchange(proxy.port, get(target))
    assert response.status == 400, response
    error = response.error()
    assert error["code"] == "invalid_path" and error["type"] == "invalid_request_error"
    assert rec.paths == [], f"{target!r} reached the upstream as {rec.paths}"


async def test_hostile_post_is_refused_before_its_body_is_forwarded(guarded: tuple[Recorder, TestServer]) -> None:
    rec, proxy = guarded
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    request = (
        b"POST /v1/%2e%2e/%2e%2e/admin/chat/completions HTTP/1.1\r\nHost: kvwarm\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    response = await exchange(proxy.port, request)
    assert response.status == 400 and response.error()["code"] == "invalid_path"
    assert rec.paths == []


@pytest.mark.parametrize(
    ("target", "forwarded"),
    [
        ("/v1/models", "/base/v1/models"),
        ("/v1/models/gpt-4o-mini", "/base/v1/models/gpt-4o-mini"),
        ("/v1/files/file-abc:1@x~y", "/base/v1/files/file-abc:1@x~y"),
        ("/v1/models?limit=2", "/base/v1/models?limit=2"),
        ("/v1/a...b/...", "/base/v1/a...b/..."),
        ("/v1/%61bc", "/base/v1/abc"),  # an unreserved letter, encoded: the same path
    ],
)
async def test_ordinary_paths_reach_the_upstream_under_its_base(
    guarded: tuple[Recorder, TestServer], target: str, forwarded: str
) -> None:
    rec, proxy = guarded
    response = await exchange(proxy.port, get(target))
    assert response.status == 200, response
    assert rec.paths == [forwarded]


async def test_the_error_is_not_a_traceback_in_the_log(guarded: tuple[Recorder, TestServer], caplog: Any) -> None:
    _rec, proxy = guarded
    caplog.set_level("INFO")
    await exchange(proxy.port, get("/v1/a%00b"))
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "proxy.app"]
    assert "-> 400" in line
    assert "\x00" not in line and "\n" not in line
