"""A ping's bytes (proxy/keepalive/ping.py): the request as forwarded, cut at its last breakpoint,
the least output asked for, every kept byte the forwarded one. Pure."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.core.breakpoints import CACHE_CONTROL, OPENAI
from proxy.keepalive.keeper import USER_AGENT, ping_headers
from proxy.keepalive.ping import CHAT, MESSAGES, RESPONSES, api_of, output_limit, ping_body
from tests.sim.conftest import WEATHER_TOOL

CC = {"type": "ephemeral"}
BP = {"mode": "explicit"}


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Rules.", "cache_control": CC}]},
            {"role": "user", "content": [{"type": "text", "text": "Fix it.", "cache_control": CC}]},
            {"role": "assistant", "content": "Sure: "},
        ],
        "tools": [WEATHER_TOOL],
        "tool_choice": "auto",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 4096,
        "n": 2,
        **extra,
    }


def test_chat_is_cut_after_its_last_marker_and_asks_for_one_token() -> None:
    raw = orjson.dumps(chat(temperature=0.2))
    ping = ping_body(CHAT, raw, CACHE_CONTROL)
    assert ping is not None
    body = orjson.loads(ping)
    sent = orjson.loads(raw)
    assert body["messages"] == sent["messages"][:2]  # the prefill after the marker is left out
    assert body["tools"] == sent["tools"] and body["tool_choice"] == "auto"
    assert body["max_tokens"] == 1
    for gone in ("stream", "stream_options", "n"):
        assert gone not in body


def test_the_kept_bytes_are_the_forwarded_bytes() -> None:
    """Nothing is re-serialized: an odd number and the client's spacing survive as they came."""
    raw = (
        b'{ "model" : "m", "temperature": 1E0, "messages": [ {"role":"user","content":[{"type":"text","text":"a",'
        b'"cache_control":{"type":"ephemeral"}}]} , {"role":"assistant","content":"b"} ], "stream": true }'
    )
    ping = ping_body(CHAT, raw, CACHE_CONTROL)
    assert ping == (
        b'{"model" : "m","temperature": 1E0,"messages": [ {"role":"user","content":[{"type":"text","text":"a",'
        b'"cache_control":{"type":"ephemeral"}}]} ],"max_tokens":1}'
    )


def test_a_top_level_marker_keeps_the_whole_request() -> None:
    raw = orjson.dumps({**chat(), "cache_control": CC})
    body = orjson.loads(ping_body(CHAT, raw, CACHE_CONTROL) or b"null")
    assert len(body["messages"]) == 3 and body["cache_control"] == CC


def test_openai_cuts_at_the_implicit_breakpoint_and_uses_max_completion_tokens() -> None:
    request = chat()
    for message in request["messages"]:
        if isinstance(message["content"], list):
            message["content"][0].pop("cache_control")
    request["messages"].append({"role": "tool", "tool_call_id": "c1", "content": "42"})
    request["messages"].append({"role": "assistant", "content": "So "})
    del request["max_tokens"]
    body = orjson.loads(ping_body(CHAT, orjson.dumps(request), OPENAI) or b"null")
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool"]
    assert body["max_completion_tokens"] == 1 and "max_tokens" not in body


def test_openai_keeps_the_client_s_output_parameter_name() -> None:
    body = orjson.loads(ping_body(CHAT, orjson.dumps(chat()), OPENAI) or b"null")
    assert body["max_tokens"] == 1  # the request used max_tokens: the ping does too


def test_openai_explicit_breakpoint_on_a_later_message() -> None:
    request = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"},
            {"role": "developer", "content": [{"type": "text", "text": "Note.", "prompt_cache_breakpoint": BP}]},
            {"role": "assistant", "content": "B"},
        ],
    }
    body = orjson.loads(ping_body(CHAT, orjson.dumps(request), OPENAI) or b"null")
    assert len(body["messages"]) == 3


def test_responses_asks_for_sixteen_tokens_and_stores_nothing() -> None:
    request = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "developer", "content": "Rules."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go."}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
            {"type": "reasoning", "encrypted_content": "x"},
        ],
        "store": True,
        "stream": True,
        "max_output_tokens": 1000,
        "background": False,
    }
    body = orjson.loads(ping_body(RESPONSES, orjson.dumps(request), OPENAI) or b"null")
    assert body["input"] == request["input"][:4]
    assert body["max_output_tokens"] == 16 and body["store"] is False
    assert "stream" not in body and "background" not in body and body["instructions"] == "Be brief."


def test_responses_with_a_string_input_is_kept_whole() -> None:
    body = orjson.loads(ping_body(RESPONSES, b'{"model":"m","input":"hi","prompt_cache_key":"k"}', OPENAI) or b"null")
    assert body == {"model": "m", "input": "hi", "prompt_cache_key": "k", "max_output_tokens": 16, "store": False}


def test_messages_with_thinking_asks_for_its_budget_plus_one() -> None:
    request = {
        "model": "claude",
        "system": [{"type": "text", "text": "Rules.", "cache_control": CC}],
        "messages": [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "text", "text": "out", "cache_control": CC}]}]},
        ],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "max_tokens": 32000,
        "stream": True,
    }
    raw = orjson.dumps(request)
    body = orjson.loads(ping_body(MESSAGES, raw, CACHE_CONTROL) or b"null")
    assert body["max_tokens"] == 1025 == output_limit(MESSAGES, raw)
    assert body["messages"] == request["messages"] and body["thinking"] == request["thinking"]
    del request["thinking"]
    assert orjson.loads(ping_body(MESSAGES, orjson.dumps(request), CACHE_CONTROL) or b"null")["max_tokens"] == 1


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","messages":[{"role":"user","content":"no marker"}]}',  # nothing to cut at
        b'{"model":"m","model":"n","messages":[{"role":"user","content":[{"type":"text","text":"a","cache_control":{}}]}]}',
        b'[1, 2]',
        b'{"model":"m","messages":"not a list"}',
        b"not json",
    ],
)
def test_no_ping_where_the_request_cannot_be_cut(raw: bytes) -> None:
    assert ping_body(CHAT, raw, CACHE_CONTROL) is None


def test_api_of_a_path() -> None:
    assert api_of("/v1/chat/completions") == CHAT
    assert api_of("/v1/responses") == RESPONSES
    assert api_of("/v1/messages") == MESSAGES
    assert api_of("/v1/embeddings") is None


def test_a_ping_carries_the_session_s_credential_and_its_api_s_headers_only() -> None:
    incoming = {
        "Authorization": "Bearer sk-tenant", "Cookie": "session=1", "X-Tenant": "acme", "User-Agent": "agent/1",
        "OpenAI-Project": "proj", "Content-Length": "10",
    }
    assert dict(ping_headers(incoming)) == {
        "Content-Type": "application/json", "User-Agent": USER_AGENT, "OpenAI-Project": "proj",
        "Authorization": "Bearer sk-tenant",
    }
    anthropic = {"x-api-key": "sk-ant-tenant", "anthropic-version": "2023-06-01", "anthropic-beta": "b1"}
    assert dict(ping_headers(anthropic))["x-api-key"] == "sk-ant-tenant"
    assert dict(ping_headers(anthropic))["anthropic-beta"] == "b1"


def test_with_an_upstream_api_key_no_client_credential_travels() -> None:
    """As for every request (``upstream.api_key``): the server's key, in the header the API takes."""
    headers = dict(ping_headers({"Authorization": "Bearer sk-tenant", "api-key": "k"}, api_key="sk-server"))
    assert headers["Authorization"] == "Bearer sk-server" and "api-key" not in headers
    headers = dict(ping_headers({"x-api-key": "sk-ant", "anthropic-version": "2023-06-01"}, api_key="sk-server"))
    assert headers["x-api-key"] == "sk-server" and "Authorization" not in headers
