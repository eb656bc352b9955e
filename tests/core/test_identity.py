"""Identity is blind to exactly the safe drifts (docs/ARCHITECTURE.md, "Identity") and sees every semantic one."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from proxy.core.identity import (
    RAW_ARGUMENTS,
    canonical_arguments,
    identify_message,
    message_identity,
    tools_identity,
)
from proxy.core.policy import Policy
from tests.core.factories import READ, SEARCH, WEATHER, assistant, call, result, system, user


def same(a: Any, b: Any, policy: Policy | None = None) -> bool:
    return message_identity(a, policy) == message_identity(b, policy)


CALLS = assistant(
    None,
    call("call_1", "get_weather", {"city": "北京", "days": 1}),
    call("call_2", "search", {"query": "rain", "limit": 3}),
)


# -- safe drifts: identity unchanged ---------------------------------------------------------


@pytest.mark.parametrize(
    ("drifted"),
    [
        pytest.param({"content": "hello there", "role": "user"}, id="message-keys"),
        pytest.param({"role": "user", "content": "hello there", "name": ""}, id="name-empty"),
        pytest.param({"role": "user", "content": "hello there", "name": None}, id="name-null"),
        pytest.param(
            {"role": "user", "content": "hello there", "cache_control": {"type": "ephemeral"}},
            id="cc-msg",
        ),
        pytest.param(
            {"role": "user", "content": [{"type": "text", "text": "hello there"}]}, id="one-part"
        ),
        pytest.param(
            {
                "role": "user",
                "content": [
                    {"text": "hello there", "type": "text", "cache_control": {"type": "ephemeral"}}
                ],
            },
            id="one-part-cc",
        ),
        pytest.param({"role": "user", "content": "  hello there\n"}, id="edge-whitespace"),
        pytest.param(
            {"role": "user", "content": [{"type": "text", "text": "hello there\n\n"}]},
            id="part-whitespace",
        ),
    ],
)
def test_user_message_safe_drifts(drifted: dict[str, Any]) -> None:
    assert same(user("hello there"), drifted)


def test_list_with_cache_control_back_to_string() -> None:
    listed = {
        "role": "user",
        "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
    }
    assert same(listed, user("hi"))
    # ... and two lists that differ only in where the marker sits
    moved = {
        "role": "user",
        "content": [
            {"cache_control": {"type": "ephemeral", "ttl": "1h"}, "type": "text", "text": "hi"}
        ],
    }
    assert same(listed, moved)


@pytest.mark.parametrize(
    "field",
    ["refusal", "annotations", "audio", "function_call", "name", "reasoning_content"],
)
@pytest.mark.parametrize("empty", [None, [], ""])
def test_empty_fields_equal_absent(field: str, empty: Any) -> None:
    reply = assistant("Sunny today.")
    assert same(reply, {**reply, field: empty})


@pytest.mark.parametrize("empty", [None, []])
def test_tool_calls_empty_equal_absent(empty: Any) -> None:
    assert same(assistant("ok"), assistant("ok", tool_calls=empty))


@pytest.mark.parametrize("content", ["", None])
def test_assistant_with_tool_calls_content_empty_or_null(content: Any) -> None:
    a = assistant(None, call("c1", "search", {"query": "x"}))
    b = {**a, "content": content}
    c = {k: v for k, v in a.items() if k != "content"}
    assert same(a, b)
    assert same(a, c)


def test_transport_index_and_null_fields_inside_tool_calls() -> None:
    drifted = orjson.loads(orjson.dumps(CALLS))
    for i, c in enumerate(drifted["tool_calls"]):
        c["index"] = i
        c["function"]["cache_control"] = None
    drifted["refusal"] = None
    drifted["annotations"] = []
    drifted["audio"] = None
    drifted["function_call"] = None
    assert same(CALLS, drifted)


@pytest.mark.parametrize(
    "reserialize",
    [
        pytest.param(lambda v: json.dumps(v), id="python-json-dumps-unicode-escapes"),
        pytest.param(
            lambda v: json.dumps(dict(reversed(list(v.items()))), ensure_ascii=False),
            id="keys-reordered",
        ),
        pytest.param(lambda v: json.dumps(v, indent=2, ensure_ascii=False), id="indented"),
        pytest.param(
            lambda v: " " + json.dumps(v, separators=(" , ", " : ")) + "\n", id="whitespace"
        ),
    ],
)
def test_arguments_reserialized(reserialize: Any) -> None:
    value = {
        "city": "北京",
        "days": 1,
        "opts": {"unit": "C", "hours": [1, 2, 3]},
        "note": 'a "quoted" \\ line\n',
    }
    original = assistant(None, call("c1", "get_weather", value))
    drifted = assistant(None, call("c1", "get_weather", reserialize(value)))
    assert (
        original["tool_calls"][0]["function"]["arguments"]
        != drifted["tool_calls"][0]["function"]["arguments"]
    )
    assert same(original, drifted)


def test_tool_calls_order() -> None:
    swapped = {**CALLS, "tool_calls": list(reversed(CALLS["tool_calls"]))}
    assert same(CALLS, swapped)


def test_tool_call_keys_reordered() -> None:
    c = CALLS["tool_calls"][0]
    reordered = {
        "function": {"arguments": c["function"]["arguments"], "name": c["function"]["name"]},
        "type": "function",
        "id": c["id"],
    }
    assert same(CALLS, {**CALLS, "tool_calls": [reordered, CALLS["tool_calls"][1]]})


def test_unknown_keys_canonicalized_not_ignored() -> None:
    a = user("hi", metadata={"b": 1, "a": [1, {"y": None, "x": 2}]})
    b = user("hi", metadata={"a": [1, {"x": 2}], "b": 1})
    assert same(a, b)


def test_tools_identity_safe_drifts() -> None:
    base = tools_identity([WEATHER, SEARCH, READ])
    assert tools_identity([READ, WEATHER, SEARCH]) == base
    reordered_keys = [
        orjson.loads(orjson.dumps(d, option=orjson.OPT_SORT_KEYS)) for d in (WEATHER, SEARCH, READ)
    ]
    assert tools_identity(reordered_keys) == base
    reparsed = [json.loads(json.dumps(d, indent=4)) for d in (SEARCH, READ, WEATHER)]
    assert tools_identity(reparsed) == base
    assert (
        tools_identity([WEATHER, SEARCH, {**READ, "cache_control": {"type": "ephemeral"}}]) == base
    )


@pytest.mark.parametrize("absent", [None, []])
def test_tools_absent_null_empty_equal(absent: Any) -> None:
    assert tools_identity(absent) == tools_identity([])


def test_identities_are_16_bytes() -> None:
    assert len(message_identity(user("x"))) == 16
    assert len(tools_identity([WEATHER])) == 16


# -- semantic drifts: identity changes -------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(user("hello there"), user("hello  there"), id="inner-whitespace"),
        pytest.param(user("hi"), user("Hi"), id="case"),
        pytest.param(user("hi"), system("hi"), id="role"),
        pytest.param(user("hi"), user("[Mon 10:01] calendar: standup\n\nhi"), id="context-added"),
        pytest.param(
            user("hi"),
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "[Mon 10:01] info"},
                    {"type": "text", "text": "hi"},
                ],
            },
            id="context-added-as-parts",
        ),
        pytest.param(user("hi", name="alice"), user("hi", name="bob"), id="name"),
        pytest.param(
            result("call_1", "ok"), result("functions_call_1_ab12cd", "ok"), id="tool_call_id"
        ),
        pytest.param(assistant("x"), assistant("x", refusal="I can't"), id="refusal-text"),
        pytest.param(
            assistant("x"), assistant("x", annotations=[{"type": "url_citation"}]), id="annotations"
        ),
        pytest.param(
            assistant("x"), assistant("x", reasoning_content="think"), id="reasoning-added"
        ),
        pytest.param(
            assistant("x", reasoning_content="a"),
            assistant("x", reasoning_content="b"),
            id="reasoning-changed",
        ),
        pytest.param(
            assistant("x", reasoning="a"), assistant("x", thinking="a"), id="reasoning-renamed"
        ),
        pytest.param(
            assistant("x", thought_signature="c2lnMQ=="),
            assistant("x", thought_signature="c2lnMg=="),
            id="signature",
        ),
        pytest.param(user("hi"), user("hi", vendor_ext={"x": 1}), id="unknown-key"),
        pytest.param(
            user("hi", vendor_ext={"x": 1}), user("hi", vendor_ext={"x": 2}), id="unknown-value"
        ),
        pytest.param(user(" "), user("."), id="blank-vs-text"),
    ],
)
def test_semantic_drifts_change_identity(a: Any, b: Any) -> None:
    assert not same(a, b)


def test_tool_call_ids_regenerated() -> None:
    regenerated = orjson.loads(orjson.dumps(CALLS))
    regenerated["tool_calls"][0]["id"] = "functions.get_weather:0"
    assert not same(CALLS, regenerated)


def test_tool_call_name_changed() -> None:
    renamed = orjson.loads(orjson.dumps(CALLS))
    renamed["tool_calls"][0]["function"]["name"] = "get_forecast"
    assert not same(CALLS, renamed)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param('{"n":1}', '{"n":1.0}', id="int-vs-float"),
        pytest.param('{"n":1.0}', '{"n":1.00}', id="float-text"),
        pytest.param('{"n":1e2}', '{"n":100}', id="exponent"),
        pytest.param('{"n":12345678901234567890}', '{"n":12345678901234567891}', id="u64-edge"),
        pytest.param(
            '{"n":123456789012345678901234567890}',
            '{"n":123456789012345678901234567891}',
            id="bigint",
        ),
        pytest.param('{"a":1,"a":2}', '{"a":2}', id="duplicate-keys"),
        pytest.param('{"a":1,"a":2}', '{"a":2,"a":1}', id="duplicate-keys-order"),
        pytest.param('{"a":null}', "{}", id="null-member"),
        pytest.param('{"a":[]}', "{}", id="empty-list-member"),
        pytest.param('["a","b"]', '["b","a"]', id="array-order"),
        pytest.param("{bad json", "{bad json ", id="raw-unparseable"),
        pytest.param("abc", '"abc"', id="raw-vs-json-string"),
        pytest.param('{"x":NaN}', '{"x":null}', id="nan"),
        pytest.param('{"s":"a"}', '{"s":"a "}', id="string-value-whitespace"),
    ],
)
def test_semantic_argument_changes(a: str, b: str) -> None:
    assert canonical_arguments(a) != canonical_arguments(b)
    ma = assistant(None, call("c1", "f", a))
    mb = assistant(None, call("c1", "f", b))
    assert not same(ma, mb)


def test_canonical_arguments_rules() -> None:
    assert canonical_arguments('{ "b" : 2, "a" : "\\u5317" }') == '{"a":"北","b":2}'.encode()
    assert canonical_arguments('{"n": 1.50, "m": -0}') == b'{"m":-0,"n":1.50}'
    assert canonical_arguments('{"a":1,"a":1}') == RAW_ARGUMENTS + b'{"a":1,"a":1}'
    assert canonical_arguments("not json") == RAW_ARGUMENTS + b"not json"
    assert canonical_arguments("\ud800") == RAW_ARGUMENTS + "\ud800".encode(
        "utf-8", "surrogatepass"
    )
    deep = "[" * 400 + "]" * 400
    assert canonical_arguments(deep).startswith(RAW_ARGUMENTS)


def test_tools_semantic_changes() -> None:
    base = tools_identity([WEATHER, SEARCH])
    assert tools_identity([WEATHER]) != base
    assert tools_identity([WEATHER, SEARCH, READ]) != base
    described = orjson.loads(orjson.dumps(SEARCH))
    described["function"]["description"] = "Search the web. Today is 2026-11-03."
    assert tools_identity([WEATHER, described]) != base
    required = orjson.loads(orjson.dumps(SEARCH))
    required["function"]["parameters"]["required"] = []
    assert tools_identity([WEATHER, required]) != base


def test_tools_and_messages_never_collide() -> None:
    assert tools_identity([]) != message_identity([])


# -- pinning ---------------------------------------------------------------------------------


def test_pin_patterns_mask_only_their_role() -> None:
    policy = Policy.build(True, False, {"system": [r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"]})
    a = system("Now: 2026-11-03T10:00:00Z. Be brief.")
    b = system("Now: 2026-11-03T10:05:13Z. Be brief.")
    assert not same(a, b)
    assert same(a, b, policy)
    assert not same(user(a["content"]), user(b["content"]), policy)
    assert not same(a, system("Now: 2026-11-03T10:00:00Z. Be verbose."), policy)


def test_policy_rejects_bad_patterns() -> None:
    from proxy.config import RepairSettings
    from proxy.core.errors import InvalidSetting
    from proxy.errors import ConfigError

    with pytest.raises(InvalidSetting, match=r"repair\.pin_patterns\.system: invalid regex"):
        Policy.build(True, False, {"system": ["("]})
    with pytest.raises(InvalidSetting, match="matches the empty string"):
        Policy.build(True, False, {"system": ["x*"]})
    # The edge names the key as a configuration error.
    with pytest.raises(ConfigError) as info:
        RepairSettings(pin_patterns={"user": ("x*",)}).policy()
    assert info.value.key == "repair.pin_patterns.user"


# -- robustness and the fast path ------------------------------------------------------------


@pytest.mark.parametrize(
    "odd",
    [
        None,
        "text",
        42,
        [1, 2],
        {"role": 3},
        {"content": {"nested": None}},
        {"role": "user", "content": 2**80},
        {1: {}, "1": {}, "s": "\ud800"},
        object(),
    ],
)
def test_message_identity_never_raises(odd: Any) -> None:
    assert len(message_identity(odd)) == 16


def test_clean_messages_take_the_fast_path_with_the_same_identity() -> None:
    clean = {"role": "user", "content": "hello", "name": "alice"}
    identity, size = identify_message(clean)
    assert size == len(orjson.dumps(clean))
    # the normalizing path reaches the same identity through a drifted form of it
    drifted_identity, drifted_size = identify_message(
        {"name": "alice", "content": [{"type": "text", "text": "hello "}], "role": "user"}
    )
    assert drifted_size == -1
    assert drifted_identity == identity


@pytest.mark.parametrize(
    "msg",
    [
        user("x "),
        user("x", refusal=None),
        user("x", cache_control="scalar"),
        {"role": "user", "content": [{"type": "text", "text": "x"}]},
        assistant(None, call("c", "f", "{}")),
    ],
)
def test_messages_needing_normalization_skip_the_fast_path(msg: Any) -> None:
    assert identify_message(msg)[1] == -1
