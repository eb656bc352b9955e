"""The repair plan: set the token-bearing values of the matched prefix back to their stored form.

Only inside the matched prefix, only when the policy allows it, and only the values that
become tokens: ``content`` (and its text parts' ``text``), ``tool_calls[*].function.arguments``,
the order of ``tool_calls``, the order of a tool-result group, and the ``tools`` array.
Every other key stays exactly as the client sent it (``cache_control``, vendor extensions,
``refusal: null`` ...), and so does the client's content form (string or one text part).

Whether an element needs repair is decided on serialized bytes, never with ``==`` on
parsed values (dict equality ignores key order, one of the drifts being repaired). The
identity match guarantees that a restored value means the same as the client's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from .identity import (
    canonical_tool_call,
    canonical_tool_definition,
    is_text_part,
    single_text,
    strip_cache_control,
)
from .match import Match, tool_groups
from .policy import Policy
from .splice import Edit, Insert, Reorder, Replace

__all__ = ["REPAIR_KINDS", "Repair", "RepairPlan", "plan_repair"]

REPAIR_KINDS = (
    "whitespace",
    "arguments",
    "tool_calls_order",
    "tool_results_order",
    "tools_order",
    "tools_schema",
    "pinned",
    "content_parts",
    "duplicate_collapsed",
)
"""Every :attr:`Repair.kind` (a bounded metrics label)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Repair:
    depth: int
    """Element depth (0 = tools). For ``duplicate_collapsed``: the forwarded depth the dropped
    message would have had (the depth of the element that now follows its original)."""
    kind: str
    """One of :data:`REPAIR_KINDS`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RepairPlan:
    repairs: tuple[Repair, ...]
    body: dict[str, Any] | None
    """The body as forwarded, parsed; None: nothing changed, forward the client's original bytes."""
    rescued_tokens: int
    """Tokens of the matched elements from the first repaired one onward (what would have been re-prefilled)."""
    edits: tuple[Edit, ...] = ()
    """The same repair as byte-exact edits of the client's body (paths in the client's indices),
    for :func:`proxy.core.splice.splice`: every byte outside the repaired values stays the client's."""


NO_REPAIR = RepairPlan(repairs=(), body=None, rescued_tokens=0)

_SAME: Any = object()


def plan_repair(body: Mapping[str, Any], match: Match, policy: Policy) -> RepairPlan:
    """What to change in ``body`` so its matched prefix forwards the stored bytes. Never mutates ``body``."""
    if not policy.repair:
        return NO_REPAIR
    raw = body.get("messages")
    messages: list[Any] = raw if type(raw) is list else []
    repairs: list[Repair] = []
    edits: list[Edit] = []
    new_tools = _tools_repair(body, match, repairs, edits)

    order = match.order
    moved = not match.ordered and order != tuple(range(len(messages)))
    out: list[Any] | None = [messages[i] for i in order] if moved else None
    if moved:
        repairs.extend(_order_repairs(messages, order))
        edits.append(Reorder(path=("messages",), order=tuple(order)))
    out = _repair_messages(messages, match, out, repairs, edits)

    if not repairs:
        return NO_REPAIR
    new_body = dict(body)
    if new_tools is not _SAME:
        new_body["tools"] = new_tools
    if out is not None:
        new_body["messages"] = out
    first = min(r.depth for r in repairs)
    rescued = sum(n.tokens for n in match.nodes[first:])
    repairs.sort(key=lambda r: r.depth)
    return RepairPlan(repairs=tuple(repairs), body=new_body, rescued_tokens=rescued, edits=tuple(edits))


def _tools_repair(body: Mapping[str, Any], match: Match, repairs: list[Repair], edits: list[Edit]) -> Any:
    """The stored tools array to forward, its repair and edit appended to ``repairs`` and
    ``edits``; ``_SAME`` when the tools are not matched, known clean, or forward as they are."""
    if match.matched < 1 or match.tools_clean:
        return _SAME
    fixed_tools = _repair_tools(body.get("tools"), match.nodes[0].body)
    if fixed_tools is None:
        return _SAME
    new_tools, kind = fixed_tools
    repairs.append(Repair(depth=0, kind=kind))
    edits.append(Replace(path=("tools",), value=orjson.dumps(new_tools)))
    return new_tools


def _repair_messages(
    messages: list[Any], match: Match, out: list[Any] | None, repairs: list[Repair], edits: list[Edit]
) -> list[Any] | None:
    """Put back the stored form of each matched message, from ``match.clean`` on, that does not
    forward its stored bytes, its repairs and edits appended to ``repairs`` and ``edits``.
    ``out``: the forwarded messages when they were reordered, else None (``messages`` is copied
    at the first repair). The forwarded messages; None while nothing changed them."""
    order = match.order
    last = len(order) - 1
    nodes = match.nodes
    sizes = match.clean_sizes
    dumped = match.dumped
    for p in range(max(0, min(match.clean, last)), min(match.matched - 1, len(order))):
        msg = messages[order[p]]
        node = nodes[p + 1]
        size = sizes[p + 1] if p + 1 < len(sizes) else -1
        if size >= 0:
            # A clean message serializes to exactly its canonical form up to key order; the
            # stored body canonicalizes to the same form (same identity) and could only be
            # longer (whitespace, empty fields, list form, cache_control). Equal length: no drift.
            if size == len(node.body):
                continue
        else:
            data = dumped[p + 1] if p + 1 < len(dumped) else None
            try:
                if (data if data is not None else orjson.dumps(msg)) == node.body:
                    continue
            except TypeError:  # not JSON orjson writes: nothing kvwarm could forward anyway
                continue
        final = p == last and type(msg) is dict and msg.get("role") == "assistant"
        fixed = _repair_message(msg, node.body, final=final)
        if fixed is None:
            continue
        new_msg, kinds, changes = fixed
        if out is None:
            out = list(messages)
        out[p] = new_msg
        repairs.extend(Repair(depth=p + 1, kind=k) for k in kinds)
        edits.extend(_at(("messages", order[p]), change) for change in changes)
    return out


def _at(prefix: tuple[str | int, ...], edit: Edit) -> Edit:
    """``edit`` (relative to one message) at ``prefix`` in the body."""
    if isinstance(edit, Replace):
        return Replace(path=prefix + edit.path, value=edit.value)
    if isinstance(edit, Reorder):
        return Reorder(path=prefix + edit.path, order=edit.order)
    return Insert(path=prefix + edit.path, key=edit.key, value=edit.value)


def _order_repairs(messages: Sequence[Any], order: Sequence[int]) -> list[Repair]:
    """Repairs recorded for moved messages: whole tool-result groups put back in their stored
    order, and replayed duplicates dropped."""
    out: list[Repair] = []
    position = {r: p for p, r in enumerate(order)}
    for start, end in tool_groups(messages).items():
        seq = [position[r] for r in range(start, end) if r in position]
        if seq != sorted(seq):
            out.append(Repair(depth=min(seq) + 1, kind="tool_results_order"))
    kept = 0
    for r in range(len(messages)):
        if r in position:
            kept += 1
        else:
            out.append(Repair(depth=kept + 1, kind="duplicate_collapsed"))
    return out


# -- tools -------------------------------------------------------------------------------------


def _repair_tools(client: Any, stored_body: bytes) -> tuple[list[Any], str] | None:
    """The stored tools array, each definition carrying the client's own ``cache_control``."""
    if stored_body == b"[]" or type(client) is not list:
        # Never add ``tools: []`` where the client sent none: some providers reject it.
        return None
    client_bytes = orjson.dumps(client)
    if client_bytes == stored_body:
        return None
    try:
        stored = orjson.loads(stored_body)
    except orjson.JSONDecodeError:
        return None
    if type(stored) is not list or len(stored) != len(client):
        return None
    pool: dict[bytes, list[int]] = {}
    for i, d in enumerate(client):
        pool.setdefault(canonical_tool_definition(d), []).append(i)
    repaired: list[Any] = []
    for d in stored:
        slots = pool.get(canonical_tool_definition(d))
        if not slots:
            return None  # not the same set after all: leave it as sent
        c = client[slots.pop(0)]
        d = strip_cache_control(d)
        if type(c) is dict and "cache_control" in c and type(d) is dict:
            d = {**d, "cache_control": c["cache_control"]}
        repaired.append(d)
    if orjson.dumps(repaired) == client_bytes:
        return None
    as_sent = sorted(orjson.dumps(strip_cache_control(d)) for d in client)
    as_stored = sorted(orjson.dumps(strip_cache_control(d)) for d in stored)
    return repaired, ("tools_order" if as_sent == as_stored else "tools_schema")


# -- messages ----------------------------------------------------------------------------------


def _repair_message(
    msg: Any, stored_body: bytes, *, final: bool
) -> tuple[dict[str, Any], list[str], list[Edit]] | None:
    if type(msg) is not dict:
        return None
    try:
        stored = orjson.loads(stored_body)
    except orjson.JSONDecodeError:
        return None
    if type(stored) is not dict:
        return None
    out: dict[str, Any] | None = None
    kinds: list[str] = []
    changes: list[Edit] = []
    content, kind = _repair_content(msg.get("content"), stored.get("content"), final=final)
    if content is not _SAME:
        out = dict(msg)
        out["content"] = content
        kinds.append(kind)
        changes.append(Replace(path=("content",), value=orjson.dumps(content)))
    calls = msg.get("tool_calls")
    stored_calls = stored.get("tool_calls")
    if type(calls) is list and type(stored_calls) is list and calls and stored_calls:
        fixed = _repair_tool_calls(calls, stored_calls)
        if fixed is not None:
            if out is None:
                out = dict(msg)
            out["tool_calls"] = fixed[0]
            kinds.extend(fixed[1])
            changes.extend(fixed[2])
    if out is None:
        return None
    return out, kinds, changes


def _restore_text(client: str, stored: str, *, final: bool) -> str:
    if final:
        # A final assistant message is a prefill: never give it trailing whitespace the client
        # did not send (some providers reject it). Keep the client's own tail.
        return stored.rstrip() + client[len(client.rstrip()) :]
    return stored


def _text_kind(client: str, restored: str) -> str:
    return "whitespace" if client.strip() == restored.strip() else "pinned"


def _repair_content(client: Any, stored: Any, *, final: bool) -> tuple[Any, str]:
    """(new content in the client's form, kind), or (_SAME, "")."""
    ct = "" if client is None else single_text(client)
    st = "" if stored is None else single_text(stored)
    if ct is not None and st is not None:
        if ct == st:
            return _SAME, ""
        restored = _restore_text(ct, st, final=final)
        if restored == ct:
            return _SAME, ""
        kind = _text_kind(ct, restored)
        if client is None or restored == "":
            # No client form to keep, or nothing left to say: the stored value as it was accepted
            # (null, "", a text part) -- never an empty text part of our making.
            return (stored if restored == st else restored), kind
        if type(client) is str:
            return restored, kind
        part = dict(client[0])  # keep the part's cache_control and key order
        part["text"] = restored
        return [part], kind
    if type(client) is list and type(stored) is list and len(client) == len(stored):
        new: list[Any] | None = None
        for i, (cp, sp) in enumerate(zip(client, stored, strict=True)):
            if not (is_text_part(cp) and is_text_part(sp)) or cp["text"] == sp["text"]:
                continue
            restored = _restore_text(cp["text"], sp["text"], final=final and i == len(client) - 1)
            if restored == cp["text"]:
                continue
            if new is None:
                new = list(client)
            part = dict(cp)
            part["text"] = restored
            new[i] = part
        if new is not None:
            return new, "content_parts"
    return _SAME, ""


def _arguments(call: Any) -> str | None:
    if type(call) is dict:
        function = call.get("function")
        if type(function) is dict:
            args = function.get("arguments")
            if type(args) is str:
                return args
    return None


def _repair_tool_calls(calls: list[Any], stored: list[Any]) -> tuple[list[Any], list[str], list[Edit]] | None:
    """The client's calls in the stored order, each with the stored argument string."""
    pool: dict[bytes, list[int]] = {}
    for i, c in enumerate(calls):
        pool.setdefault(canonical_tool_call(c), []).append(i)
    picked: list[int] = []
    for s in stored:
        slots = pool.get(canonical_tool_call(s))
        if not slots:
            return None
        picked.append(slots.pop(0))
    if len(picked) != len(calls):
        return None
    kinds: list[str] = []
    changes: list[Edit] = []
    if picked != sorted(picked):
        kinds.append("tool_calls_order")
        changes.append(Reorder(path=("tool_calls",), order=tuple(picked)))
    out: list[Any] = []
    restored_args = False
    for ci, s in zip(picked, stored, strict=True):
        c = calls[ci]
        ca, sa = _arguments(c), _arguments(s)
        if ca is not None and sa is not None and ca != sa:
            c = {**c, "function": {**c["function"], "arguments": sa}}
            restored_args = True
            changes.append(Replace(path=("tool_calls", ci, "function", "arguments"), value=orjson.dumps(sa)))
        out.append(c)
    if restored_args:
        kinds.append("arguments")
    if not kinds:
        return None
    return out, kinds, changes
