"""Invariants, property-based: identity is blind to exactly the safe drifts, repair restores the
stored token-bearing bytes and never changes meaning, semantic edits are never rewritten and are
reported, tool groups stay whole."""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.identity import message_identity, single_text
from proxy.core.match import tool_groups
from proxy.core.policy import Policy
from tests.core.factories import (
    SEARCH,
    TOOLS,
    WEATHER,
    Session,
    assistant,
    call,
    make_chat,
    result,
    system,
    user,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

texts = st.text(alphabet=st.sampled_from('ab yz\n\t北é"\\{}09'), max_size=12)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from('ab 北"\\\n'), max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet="abcxyz", max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
arguments = st.dictionaries(
    st.text(alphabet="abcdxyz", min_size=1, max_size=5), json_values, max_size=4
)
EMPTY_FIELDS = ("refusal", "annotations", "audio", "function_call", "name")


@st.composite
def conversations(draw: Any) -> tuple[list[dict[str, Any]], Any]:
    """A transcript as a client first sends it: model-written argument strings, tool groups,
    ending with a user turn (so no message is a prefill)."""
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append(system(draw(texts)))
    for t in range(draw(st.integers(1, 3))):
        msgs.append(user(draw(texts)))
        if draw(st.booleans()):
            n = draw(st.integers(1, 3))
            calls = [
                call(
                    f"call_{t}_{j}",
                    draw(st.sampled_from(["get_weather", "search"])),
                    json.dumps(draw(arguments), ensure_ascii=False, separators=(",", ":")),
                )
                for j in range(n)
            ]
            msgs.append(assistant(draw(st.none() | texts), *calls))
            msgs.extend(result(f"call_{t}_{j}", draw(texts)) for j in range(n))
        msgs.append(assistant(draw(texts)))
    msgs.append(user(draw(texts)))
    tools = draw(st.sampled_from([None, [], TOOLS, [WEATHER, SEARCH]]))
    return msgs, tools


# -- drifts ----------------------------------------------------------------------------------


def _set_text(msg: dict[str, Any], fn: Any) -> None:
    content = msg.get("content")
    if type(content) is str:
        msg["content"] = fn(content)
    elif type(content) is list and content and type(content[0]) is dict:
        content[0] = {**content[0], "text": fn(content[0]["text"])}


def safe_drift(draw: Any, msg: dict[str, Any]) -> dict[str, Any]:
    m = copy.deepcopy(msg)
    ops = draw(
        st.lists(
            st.sampled_from(
                ["reorder", "empty", "ws", "strip", "parts", "cc", "calls", "args", "index", "null"]
            ),
            max_size=5,
        )
    )
    for op in ops:
        if op == "reorder":
            m = dict(reversed(list(m.items())))
        elif op == "empty":
            field = draw(st.sampled_from(EMPTY_FIELDS))
            if field not in m:
                m[field] = draw(st.sampled_from([None, [], ""]))
        elif op == "ws":
            lead, trail = (
                draw(st.sampled_from(["", " ", "\n"])),
                draw(st.sampled_from(["", "\n", "  \n"])),
            )
            _set_text(m, lambda s, lead=lead, trail=trail: lead + s + trail)
        elif op == "strip":
            _set_text(m, str.strip)
        elif op == "parts":
            content = m.get("content")
            if type(content) is str:
                part: dict[str, Any] = {"type": "text", "text": content}
                if draw(st.booleans()):
                    part["cache_control"] = {"type": "ephemeral"}
                m["content"] = [part]
            elif single_text(content) is not None:
                m["content"] = content[0]["text"]
        elif op == "cc":
            m["cache_control"] = {"type": "ephemeral"}
        elif op == "calls" and m.get("tool_calls"):
            m["tool_calls"] = list(reversed(m["tool_calls"]))
        elif op == "args" and m.get("tool_calls"):
            ascii_, indent, sort = (
                draw(st.booleans()),
                draw(st.sampled_from([None, 2])),
                draw(st.booleans()),
            )
            for c in m["tool_calls"]:
                value = json.loads(c["function"]["arguments"])
                c["function"]["arguments"] = json.dumps(
                    value, ensure_ascii=ascii_, indent=indent, sort_keys=sort
                )
        elif op == "index" and m.get("tool_calls"):
            m["tool_calls"] = [{**c, "index": i} for i, c in enumerate(m["tool_calls"])]
        elif op == "null" and m.get("tool_calls") and not m.get("content"):
            m["content"] = draw(st.sampled_from([None, ""]))
    return m


def shuffle_groups(draw: Any, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = list(msgs)
    for start, end in tool_groups(msgs).items():
        out[start:end] = draw(st.permutations(msgs[start:end]))
    return out


def token_view(msg: Any) -> bytes:
    """The token-bearing values of a message, serialized: role, texts, and calls in order."""
    content = msg.get("content")
    text = single_text(content)
    texts_ = (
        text
        if text is not None
        else [p.get("text") for p in content]
        if type(content) is list
        else None
    )
    calls = [
        (c["id"], c["function"]["name"], c["function"]["arguments"])
        for c in msg.get("tool_calls") or []
    ]
    return orjson.dumps(
        [msg.get("role"), texts_ if texts_ != "" else None, calls, msg.get("tool_call_id")]
    )


# -- properties ------------------------------------------------------------------------------


@FAST
@given(data=st.data(), convo=conversations())
def test_safe_drifts_match_fully_and_repair_to_the_stored_bytes(data: Any, convo: Any) -> None:
    msgs, tools = convo
    s = Session()
    s.turn(make_chat(*msgs, tools=tools), None)

    drifted = shuffle_groups(data.draw, [safe_drift(data.draw, m) for m in msgs])
    drifted_tools = tools
    if tools:
        drifted_tools = data.draw(st.permutations(tools))
        if data.draw(st.booleans()):
            drifted_tools = [
                orjson.loads(orjson.dumps(d, option=orjson.OPT_SORT_KEYS)) for d in drifted_tools
            ]
    t = s.look(make_chat(*drifted, tools=drifted_tools))

    assert t.match.complete
    sent = t.forwarded["messages"]
    assert len(sent) == len(msgs)
    for p, node in enumerate(t.match.nodes[1:]):
        stored = orjson.loads(node.body)
        assert token_view(sent[p]) == token_view(stored)
        assert message_identity(sent[p]) == message_identity(stored)
    # the client's other keys survive repair
    for p, r in enumerate(t.match.order):
        assert set(sent[p]) == set(drifted[r])
    if tools:
        sent_tools = [
            {k: v for k, v in d.items() if k != "cache_control"} for d in t.forwarded["tools"]
        ]
        assert orjson.dumps(sent_tools) == t.match.nodes[0].body
    # a second look at the repaired body needs no repair at all
    again = s.look(t.forwarded)
    assert again.match.complete and again.plan.body is None


def semantic_edit(draw: Any, msg: dict[str, Any]) -> dict[str, Any]:
    m = copy.deepcopy(msg)
    options = ["text", "reasoning", "unknown"]
    if m.get("role") == "tool":
        options.append("tool_call_id")
    if m.get("tool_calls"):
        options += ["call_id", "arguments"]
    op = draw(st.sampled_from(options))
    if op == "text":
        content = m.get("content")
        if type(content) is str:
            at = draw(st.integers(0, len(content)))
            m["content"] = content[:at] + "Q" + content[at:]
        else:
            m["content"] = "Q"
    elif op == "reasoning":
        m["reasoning_content"] = "let me think"
    elif op == "unknown":
        m["x_extra"] = {"added": True}
    elif op == "tool_call_id":
        m["tool_call_id"] += "_renamed"
    elif op == "call_id":
        m["tool_calls"][0] = {**m["tool_calls"][0], "id": "regenerated"}
    else:
        f = m["tool_calls"][0]["function"]
        m["tool_calls"][0] = {
            **m["tool_calls"][0],
            "function": {**f, "arguments": '{"wrapped":' + f["arguments"] + "}"},
        }
    return m


@FAST
@given(data=st.data(), convo=conversations())
def test_semantic_edits_are_never_rewritten_and_always_reported(data: Any, convo: Any) -> None:
    msgs, tools = convo
    s = Session()
    s.turn(make_chat(*msgs, tools=tools), None)
    i = data.draw(st.integers(0, len(msgs) - 1))
    edited = (
        [safe_drift(data.draw, m) for m in msgs[:i]]
        + [semantic_edit(data.draw, msgs[i])]
        + msgs[i + 1 :]
    )
    t = s.look(make_chat(*edited, tools=tools))

    assert t.match.matched == i + 1
    assert all(r.depth <= i for r in t.plan.repairs)
    sent = t.forwarded["messages"]
    assert orjson.dumps(sent[i:]) == orjson.dumps(edited[i:]), (
        "the edited message and all after it go as sent"
    )
    assert t.brk is not None and t.brk.depth == i + 1
    if i < len(msgs) - 1 or msgs[i]["role"] != "user":
        assert t.brk.reason != "new_branch"  # a new last user turn is one; nothing else is


@FAST
@given(data=st.data(), convo=conversations(), collapse=st.booleans())
def test_tool_groups_stay_whole(data: Any, convo: Any, collapse: bool) -> None:
    msgs, tools = convo
    s = Session(policy=Policy(collapse_duplicates=collapse))
    s.turn(make_chat(*msgs, tools=tools), None)
    request = shuffle_groups(data.draw, msgs)
    groups = tool_groups(request)
    if groups and data.draw(st.booleans()):
        start, end = data.draw(st.sampled_from(sorted(groups.items())))
        j = data.draw(st.integers(start, end - 1))
        request[j] = {**request[j], "content": "rewritten by a hook"}
    t = s.look(make_chat(*request, tools=tools))

    position = {r: p for p, r in enumerate(t.match.order)}
    for start, end in groups.items():
        spots = sorted(position[r] for r in range(start, end))
        assert spots == list(range(spots[0], spots[0] + end - start)), (
            "a group is never split or thinned"
        )
        moved = [t.match.order[p] for p in spots]
        if moved != list(range(start, end)):
            # a group is only ever put back in the order the store holds, as a whole
            assert t.match.matched >= spots[-1] + 2
    sent = t.forwarded["messages"]
    assert sorted(orjson.dumps(m) for m in sent if m.get("role") == "tool") == sorted(
        orjson.dumps(m) for m in request if m.get("role") == "tool"
    )


# -- the fast paths hash exactly what the normalizing path hashes ----------------------------

edge = st.sampled_from(["", " ", "\n", "\t\n"])
contents = st.one_of(
    st.none(),
    st.builds(lambda a, t, b: a + t + b, edge, texts, edge),
    st.builds(lambda t: [{"type": "text", "text": t}], texts),
    st.builds(
        lambda t: [{"type": "text", "text": t, "cache_control": {"type": "ephemeral"}}], texts
    ),
)
raw_arguments = st.one_of(
    arguments.map(lambda v: json.dumps(v, ensure_ascii=False, separators=(",", ":"))),
    arguments.map(json.dumps),
    st.sampled_from(['{"a":1,"a":2}', "not json", '{"n": 1.50}', "", '{"x":NaN}']),
)


@st.composite
def tool_calls(draw: Any) -> list[dict[str, Any]]:
    calls = []
    for j in range(draw(st.integers(1, 3))):
        c = call(
            draw(st.sampled_from([f"id_{j}", "same", ""])),
            draw(st.sampled_from(["f", "g"])),
            draw(raw_arguments),
        )
        if draw(st.booleans()):
            c["index"] = j
        calls.append(c)
    return calls


@st.composite
def messages(draw: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": draw(st.sampled_from(["user", "assistant", "tool", "system"]))}
    content = draw(contents)
    if content is not None or draw(st.booleans()):
        msg["content"] = content
    if draw(st.booleans()):
        msg["tool_calls"] = draw(tool_calls())
    for key, values in (
        ("name", st.sampled_from(["", "bob"])),
        ("n", st.integers() | st.floats(allow_nan=False) | st.booleans()),
    ):
        if draw(st.booleans()):
            msg[key] = draw(values)
    return msg


def _forced_generic(msg: dict[str, Any]) -> dict[str, Any]:
    """A safe drift of ``msg`` (an empty field, a null key per call) that no fast path accepts."""
    out = {**msg, "refusal": None}
    if type(out.get("tool_calls")) is list:
        out["tool_calls"] = [{**c, "x_pad": None} for c in out["tool_calls"]]
    return out


@FAST
@given(msg=messages())
def test_fast_paths_agree_with_the_normalizing_path(msg: dict[str, Any]) -> None:
    identity = message_identity(msg)
    assert identity == message_identity(_forced_generic(msg))
    assert identity == message_identity(dict(reversed(list(msg.items()))))


odd_messages = st.lists(
    st.one_of(
        json_values,
        st.dictionaries(
            st.sampled_from(["role", "content", "tool_calls", "tool_call_id", "name", "x"]),
            json_values | st.sampled_from(["user", "assistant", "tool"]),
            max_size=4,
        ),
    ),
    max_size=6,
)


@FAST
@given(first=odd_messages, second=odd_messages, tools=json_values)
def test_odd_bodies_never_raise(first: list[Any], second: list[Any], tools: Any) -> None:
    s = Session(policy=Policy(collapse_duplicates=True))
    s.turn({"messages": first, "tools": tools}, None)
    assert s.look({"messages": first, "tools": tools}).match.complete
    t = s.turn({"messages": first + second, "tools": tools}, {"role": "assistant", "content": "x"})
    assert s.look({"messages": first + second, "tools": tools}).match.complete
    assert t.nodes[-1].generated
