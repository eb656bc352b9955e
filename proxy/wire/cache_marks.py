"""Cache markers in the bytes a chat or Responses request goes upstream with. Pure.

:mod:`proxy.core.breakpoints` decides where markers go (element depths, in forwarded order);
this module says what the elements of each wire API look like to a marker, and writes the
markers into the outgoing bytes with :mod:`proxy.core.splice`: every other byte stays as it was
(the client's, with a repair's values). A marker sits on an element's last block:

- chat: the last content part of a ``system``, ``developer``, ``user`` or ``tool`` message
  (a string ``content`` becomes a list of one ``text`` part carrying the marker: a string and
  one text part render the same); ``cache_control`` also on the last tool definition;
- Responses: the last ``input_text`` / ``input_image`` / ``input_file`` part of a ``system``,
  ``developer`` or ``user`` message item (a string ``content`` becomes one ``input_text``
  part), or a ``function_call_output`` item itself; ``cache_control`` also on the last tool.
  ``instructions`` and an ``input`` string carry none.

The markers are ``"prompt_cache_breakpoint": {"mode": "explicit"}`` (``openai``) and
``"cache_control": {"type": "ephemeral"}`` (``cache_control``), with no TTL. The client's own
markers are counted (:func:`client_marks`), never moved or removed. A splice that cannot be made
(:data:`~proxy.core.splice.REFUSALS`) adds nothing: the bytes go as they were, and
:attr:`~proxy.core.breakpoints.Marks.refused` says why; so does an error, which
:attr:`~proxy.core.breakpoints.Marks.error` carries to the request's fail-open boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import orjson

from ..core.breakpoints import (
    CACHE_CONTROL,
    OPENAI,
    ClientMarks,
    Elements,
    Marks,
    choose,
    dialect_of,
    reads_ours,
)
from ..core.plan import TurnPlan
from ..core.splice import Edit, Insert, Refusal, Reorder, Replace, try_splice
from ..transport.traits import UpstreamTraits

__all__ = ["KEYS", "MARKERS", "ChatElements", "ResponsesElements", "client_marks", "with_breakpoints"]

KEYS = {OPENAI: "prompt_cache_breakpoint", CACHE_CONTROL: "cache_control"}
"""The member a marker of each dialect is."""
MARKERS = {OPENAI: b'{"mode":"explicit"}', CACHE_CONTROL: b'{"type":"ephemeral"}'}
"""Its value, as kvwarm writes it (no TTL: the provider's default)."""
_ROLES = frozenset(("system", "developer", "user", "tool"))
"""Chat roles whose content may end a breakpoint (never assistant output)."""
_ITEM_ROLES = frozenset(("system", "developer", "user"))
_CHAT_PARTS = frozenset(("text", "image_url", "input_audio", "file"))
_INPUT_PARTS = frozenset(("input_text", "input_image", "input_file"))
_TEXT_PARTS = frozenset(("text", "input_text"))
_OUTPUT_ITEMS = frozenset(("function_call_output", "custom_tool_call_output"))

ElementsFactory = Callable[[str], "MarkableElements"]
"""Makes a request's elements for one dialect."""


class MarkableElements(Elements, Protocol):
    """:class:`~proxy.core.breakpoints.Elements` that can also write a marker."""

    def edit(self, depth: int) -> Edit:
        """The splice that puts the dialect's marker on the last block of element ``depth``
        (a :meth:`markable` one)."""
        ...


def with_breakpoints(
    base: bytes, body: Mapping[str, Any], plan: TurnPlan, traits: UpstreamTraits, elements: ElementsFactory
) -> tuple[bytes, Marks | None]:
    """``base`` (the bytes about to go upstream) with kvwarm's markers, and what was done; None:
    this upstream and model get no markers, or the plan knows nothing of the tree."""
    dialect = dialect_of(traits.cache_breakpoints, body.get("model"))
    match, tree = plan.match, plan.tree
    if not dialect or match is None or tree is None:
        return base, None
    try:
        client = client_marks(base, body, dialect)
        view = elements(dialect)
        chosen = choose(dialect, view, tree, match, client, tools=_has_tools(body))
        ours = reads_ours(dialect, client, match)
        marks = Marks(
            dialect=dialect, placed=chosen, client=client.count, reads_ours=ours,
            writes_ours=ours and dialect == CACHE_CONTROL,
        )
        if not chosen:
            return base, marks
        out = try_splice(base, [view.edit(m.depth) for m in chosen])
    except Exception as exc:  # the fail-open boundary is the caller's: it gets the error
        return base, Marks(dialect=dialect, refused="error", error=exc)
    if isinstance(out, Refusal):
        # What the request reads at breakpoints placed before is still kvwarm's doing.
        return base, Marks(
            dialect=dialect, client=marks.client, reads_ours=marks.reads_ours, writes_ours=marks.writes_ours,
            refused=out.reason,
        )
    return out, marks


def _has_tools(body: Mapping[str, Any]) -> bool:
    tools = body.get("tools")
    return type(tools) is list and bool(tools)


def client_marks(raw: bytes, body: Mapping[str, Any], dialect: str) -> ClientMarks:
    """The client's markers of ``dialect``: every object in the body holding the marker's key
    (a tool schema property of that name too: over-counting only leaves kvwarm fewer)."""
    key = KEYS[dialect]
    options = body.get("prompt_cache_options")
    explicit = dialect == OPENAI and isinstance(options, dict) and options.get("mode") == "explicit"
    automatic = dialect == CACHE_CONTROL and key in body
    if key.encode() not in raw and b"\\u" not in raw:  # a key may be spelled with escapes
        return ClientMarks(explicit_mode=explicit)
    count = 0
    stack: list[Any] = [body]
    while stack:
        value = stack.pop()
        if type(value) is dict:
            if key in value:
                count += 1
            stack.extend(value.values())
        elif type(value) is list:
            stack.extend(value)
    return ClientMarks(count=count, automatic=automatic, explicit_mode=explicit)


def _one_part(kind: str, text: str, dialect: str) -> bytes:
    """A content list of one text part carrying the dialect's marker."""
    return b'[{"type":"' + kind.encode() + b'","text":' + orjson.dumps(text) + b',"' + KEYS[dialect].encode() + b'":' + MARKERS[dialect] + b"}]"


def _insert(path: tuple[str | int, ...], dialect: str) -> Insert:
    return Insert(path=path, key=KEYS[dialect], value=MARKERS[dialect])


def _blank(text: Any) -> bool:
    return type(text) is not str or not text.strip()


def _last_part(content: Any) -> Any:
    return content[-1] if type(content) is list and content else None


def _part_markable(part: Any, kinds: frozenset[str]) -> bool:
    if type(part) is not dict or part.get("type") not in kinds:
        return False
    return part.get("type") not in _TEXT_PARTS or not _blank(part.get("text"))


def _last_index(content: Any) -> int:
    """The index of a content list's last part (-1, which no splice path takes, for no list)."""
    return len(content) - 1 if type(content) is list else -1


def _content_blocks(content: Any) -> int:
    return len(content) if type(content) is list else 1


class _Tools:
    """Element 0 of either API: the ``tools`` array (``cache_control`` marks its last definition)."""

    __slots__ = ("dialect", "key", "tools")

    def __init__(self, tools: Any, dialect: str) -> None:
        self.tools: list[Any] = tools if type(tools) is list else []
        self.dialect = dialect
        self.key = KEYS[dialect]

    def markable(self) -> bool:
        tools = self.tools
        return self.dialect == CACHE_CONTROL and bool(tools) and type(tools[-1]) is dict

    def marked(self) -> bool:
        tools = self.tools
        return bool(tools) and type(tools[-1]) is dict and self.key in tools[-1]

    def edit(self) -> Edit:
        return _insert(("tools", len(self.tools) - 1), self.dialect)


class ChatElements:
    """A chat request's forwarded elements (the body as forwarded: repaired values, stored order)."""

    __slots__ = ("_dialect", "_key", "_messages", "_tools")

    def __init__(self, forwarded: Mapping[str, Any], dialect: str) -> None:
        messages = forwarded.get("messages")
        self._messages: list[Any] = messages if type(messages) is list else []
        self._tools = _Tools(forwarded.get("tools"), dialect)
        self._dialect = dialect
        self._key = KEYS[dialect]

    def __len__(self) -> int:
        return 1 + len(self._messages)

    def _message(self, depth: int) -> dict[str, Any]:
        message = self._messages[depth - 1]
        return message if type(message) is dict else {}

    def role(self, depth: int) -> str:
        if depth == 0:
            return "tools"
        role = self._message(depth).get("role")
        return role if type(role) is str else ""

    def markable(self, depth: int) -> bool:
        if depth == 0:
            return self._tools.markable()
        message = self._message(depth)
        if message.get("role") not in _ROLES:
            return False
        content = message.get("content")
        if type(content) is str:
            return not _blank(content)
        return _part_markable(_last_part(content), _CHAT_PARTS)

    def marked(self, depth: int) -> bool:
        if depth == 0:
            return self._tools.marked()
        message = self._message(depth)
        last = _last_part(message.get("content"))
        return self._key in message or (type(last) is dict and self._key in last)

    def blocks(self, depth: int) -> int:
        if depth == 0:
            return max(1, len(self._tools.tools))
        message = self._message(depth)
        calls = message.get("tool_calls")
        content = message.get("content")
        parts = _content_blocks(content) if content else 0
        return max(1, parts + (len(calls) if type(calls) is list else 0))

    def edit(self, depth: int) -> Edit:
        if depth == 0:
            return self._tools.edit()
        content = self._message(depth).get("content")
        path: tuple[str | int, ...] = ("messages", depth - 1, "content")
        if type(content) is str:
            return Replace(path=path, value=_one_part("text", content, self._dialect))
        return _insert((*path, _last_index(content)), self._dialect)


class ResponsesElements:
    """A Responses request's elements: the tools, then the view's messages in forwarded order,
    each marked on the client's input item it was made from (at its place in the outgoing bytes)."""

    __slots__ = ("_dialect", "_forwarded", "_items", "_key", "_order", "_positions", "_spans", "_tools")

    def __init__(
        self,
        body: Mapping[str, Any],
        plan: TurnPlan,
        spans: Sequence[tuple[int, ...]],
        positions: Mapping[int, int] | None,
        dialect: str,
    ) -> None:
        items = body.get("input")
        self._items: list[Any] = items if type(items) is list else []
        messages = plan.forwarded.get("messages")
        self._forwarded: list[Any] = messages if type(messages) is list else []
        match = plan.match
        self._order: Sequence[int] = match.order if match is not None else ()
        self._spans = spans
        self._positions = positions
        """Original item index -> its index in the outgoing bytes (a repair reordered them); None: the same."""
        self._tools = _Tools(body.get("tools"), dialect)
        self._dialect = dialect
        self._key = KEYS[dialect]

    def __len__(self) -> int:
        return 1 + len(self._forwarded)

    def role(self, depth: int) -> str:
        if depth == 0:
            return "tools"
        message = self._forwarded[depth - 1]
        role = message.get("role") if type(message) is dict else None
        return role if type(role) is str else ""

    def _item(self, depth: int) -> tuple[int, dict[str, Any]] | None:
        """The input item (its original index) the element was made from, when it is one."""
        if not self._items or depth - 1 >= len(self._order):
            return None
        span = self._spans[self._order[depth - 1]]
        k = span[-1]
        if k < 0 or k >= len(self._items) or type(self._items[k]) is not dict:
            return None  # the instructions
        return k, self._items[k]

    def _kind(self, item: Mapping[str, Any]) -> str:
        kind = item.get("type")
        if type(kind) is str:
            return kind
        return "message" if "role" in item else ""

    def markable(self, depth: int) -> bool:
        if depth == 0:
            return self._tools.markable()
        found = self._item(depth)
        if found is None or (self._positions is not None and found[0] not in self._positions):
            return False
        item = found[1]
        kind = self._kind(item)
        if kind in _OUTPUT_ITEMS:
            return True
        if kind != "message" or item.get("role") not in _ITEM_ROLES:
            return False
        content = item.get("content")
        if type(content) is str:
            return not _blank(content) and type(self._forwarded[depth - 1].get("content")) is str
        return _part_markable(_last_part(content), _INPUT_PARTS)

    def marked(self, depth: int) -> bool:
        if depth == 0:
            return self._tools.marked()
        found = self._item(depth)
        if found is None:
            return False
        item = found[1]
        last = _last_part(item.get("content"))
        return self._key in item or (type(last) is dict and self._key in last)

    def blocks(self, depth: int) -> int:
        if depth == 0:
            return max(1, len(self._tools.tools))
        found = self._item(depth)
        if found is None:
            return 1
        item = found[1]
        kind = self._kind(item)
        content = item.get("output") if kind in _OUTPUT_ITEMS else item.get("content") if kind == "message" else None
        return max(1, _content_blocks(content) if content else 1)

    def edit(self, depth: int) -> Edit:
        if depth == 0:
            return self._tools.edit()
        found = self._item(depth)
        assert found is not None  # markable
        k, item = found
        at = self._positions[k] if self._positions is not None else k
        if self._kind(item) in _OUTPUT_ITEMS:
            return _insert(("input", at), self._dialect)
        content = item.get("content")
        if type(content) is str:
            # The text as forwarded (a repair may have restored it).
            text = self._forwarded[depth - 1]["content"]
            return Replace(path=("input", at, "content"), value=_one_part("input_text", text, self._dialect))
        return _insert(("input", at, "content", _last_index(content)), self._dialect)


def item_positions(edits: Sequence[Edit]) -> dict[int, int] | None:
    """Where a repair's item edits (:func:`~proxy.wire.responses.item_edits`) put each original
    input item in the outgoing bytes; None when they reorder nothing."""
    for edit in edits:
        if isinstance(edit, Reorder) and edit.path == ("input",):
            return {k: at for at, k in enumerate(edit.order)}
    return None
