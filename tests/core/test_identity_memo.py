"""The identity memo returns exactly what identification computes, and stays within its budget."""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.identity import IdentityMemo, identify_messages
from proxy.core.policy import Policy
from tests.agents import SAFE_DRIFTS, SYSTEM

text = st.text(max_size=40)
messages = st.lists(
    st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": text}),
        st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
            st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)}),
        st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none(), "tool_calls": st.just([
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1,"b":"x"}'}}])}),
        st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.just("call_1"), "content": text}),
    ),
    max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(msgs=messages)
def test_memo_hits_equal_fresh_identities(msgs: list[dict[str, Any]]) -> None:
    memo = IdentityMemo()
    fresh = identify_messages(msgs, Policy())
    assert identify_messages(msgs, Policy(), memo) == fresh  # misses, filling the memo
    assert identify_messages(copy.deepcopy(msgs), Policy(), memo) == fresh  # hits


def test_drifted_serializations_miss_the_memo_but_share_the_identity() -> None:
    base = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query":"北京","max_results":3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "found\n"},
    ]
    memo = IdentityMemo()
    ids, _ = identify_messages(base, Policy(), memo)
    for name in ("args_python_dumps", "null_fields", "content_as_parts", "args_keys_reordered"):
        drifted, _ = SAFE_DRIFTS[name](copy.deepcopy(base), [], 1)
        assert identify_messages(drifted, Policy(), memo)[0] == ids, name
    # A semantic change is a different identity, memo or not.
    changed = copy.deepcopy(base)
    changed[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"query": "北京", "max_results": 3.0})
    assert identify_messages(changed, Policy(), memo)[0][2] != ids[2]


def test_memo_is_bounded_by_bytes() -> None:
    memo = IdentityMemo(max_bytes=10_000)
    for i in range(500):
        identify_messages([{"role": "user", "content": f"message number {i} " * 5}], Policy(), memo)
    assert 0 < len(memo) < 500
    assert memo._size <= 10_000


def test_tools_memo_equals_fresh_identity_and_sees_drift() -> None:
    from proxy.core.identity import tools_identity
    from tests.agents import TOOLS, schema_keys_shuffled, tools_reordered

    memo = IdentityMemo()
    for tools in (TOOLS, None, [], tools_reordered([], copy.deepcopy(TOOLS), 1)[1], schema_keys_shuffled([], copy.deepcopy(TOOLS), 3)[1]):
        assert memo.tools_identity(tools) == tools_identity(tools)
        assert memo.tools_identity(copy.deepcopy(tools)) == tools_identity(tools)  # a hit
    changed = copy.deepcopy(TOOLS)
    changed[0]["function"]["description"] += "!"
    assert memo.tools_identity(changed) != memo.tools_identity(TOOLS)
