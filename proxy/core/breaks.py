"""Prefix-break diagnosis: why a request left the stored tree.

The request left the tree at element ``k = match.matched``. Element ``k`` is compared
with the stored children of element ``k - 1`` and the break is classified; the first
rule that holds wins:

1. ``new_branch`` -- node ``k-1`` has no stored child (or the tenant has nothing stored):
   a genuinely new turn, not a break;
2. ``tools_changed`` -- ``k == 0``: the tool set or a definition changed;
3. ``duplicate_replay`` -- element ``k`` repeats element ``k-1``;
4. ``reasoning_changed`` -- a stored child is the same message but for its reasoning
   (added, dropped or changed);
5. ``truncated_head`` -- ``k == 1`` and the request's first message (and the next) sit
   deeper in a stored chain: the request starts inside it;
6. ``message_removed`` -- element ``k`` is stored further down the same chain (a grandchild
   or deeper): the request skipped one message or more;
7. ``message_inserted`` -- element ``k+1`` is a stored child (the request added one);
8. ``new_branch`` -- no stored child has the role of element ``k`` (the client went on
   without it), or element ``k`` is a user message that ends the request: a new task under
   a shared system prompt, an edited last prompt -- nothing after it could have been cached;
9. ``system_changed`` -- a system / developer message whose text changed;
10. ``assistant_modified`` -- the stored child is a generated reply and the client sent another;
11. ``content_changed`` -- a stored child with the same role differs.

For ``content_changed``, ``system_changed`` and ``tools_changed`` the first differing
span is located (common prefix / suffix, widened to the whole token around it) and
reported by *shape* only -- digits as ``d``, letters as ``a`` -- with a suggested
``pin_patterns`` regex. The client's text itself is never returned.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from .identity import REASONING_KEYS, canonical_tool_definition, is_text_part, message_identity
from .match import Match
from .model import Node, NodeReader, chain
from .policy import Policy

__all__ = ["REASONS", "Break", "Span", "diagnose", "span_of"]

REASONS = (
    "content_changed",
    "message_inserted",
    "message_removed",
    "truncated_head",
    "duplicate_replay",
    "reasoning_changed",
    "assistant_modified",
    "tools_changed",
    "system_changed",
    "new_branch",
)
"""Every :attr:`Break.reason` (a bounded metrics label)."""

_MAX_CANDIDATES = 32
"""Stored children compared at most, the newest (a hot system prompt may have thousands)."""
_MAX_DEEPER = 256
"""Stored nodes with the same identity examined at most (``truncated_head``, ``message_removed``)."""
_MAX_WALK = 4096
"""Parent lookups spent at most proving that a node descends from another."""
_MAX_SHAPE = 64
"""Longest span given a shape and a hint; longer spans are cut (shape ends with an ellipsis, no hint)."""
_TOKEN_PUNCT = frozenset("-_:./+@~")
"""Characters that belong to a volatile token (timestamps, ids, paths) when widening a span."""
_REGEX_SPECIAL = frozenset(".^$*+?{}[]\\|()")
_SYSTEM_ROLES = frozenset(("system", "developer"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    depth: int
    """Element depth of the changed text."""
    offset: int
    """Start of the changed region, in characters of the client's text."""
    length: int
    """Length of the changed region in the client's text (0: the client's text lost something here)."""
    shape: str
    """The changed region with digits -> ``d``, letters -> ``a``; other characters, and a lone
    upper-case letter next to a digit (the ``T`` / ``Z`` of a timestamp), kept. Never the text itself."""
    hint: str
    """A ``pin_patterns`` regex matching that shape (empty when the span is too long to pin)."""


@dataclass(init=False, unsafe_hash=True)  # built per request (proxy/core/values.py)
class Break:
    reason: Final[str]
    """One of :data:`REASONS`."""
    depth: Final[int]
    """The first unmatched element (0 = tools)."""
    span: Final[Span | None]
    """The changed region, for content / system / tools changes."""

    def __init__(
        self,
        *,
        reason: str,
        depth: int,
        span: Span | None = None,
    ) -> None:
        self.reason = reason
        self.depth = depth
        self.span = span

    @property
    def is_break(self) -> bool:
        """False for ``new_branch``: a genuinely new turn is not a break."""
        return self.reason != "new_branch"


# -- spans -----------------------------------------------------------------------------------


def _common_prefix(a: str, b: str) -> int:
    return _common_run(a, b, min(len(a), len(b)), False)


def _common_suffix(a: str, b: str, limit: int) -> int:
    """Length of the common suffix, at most ``limit``."""
    return _common_run(a, b, limit, True)


def _common_run(a: str, b: str, n: int, from_end: bool) -> int:
    """The largest ``k <= n`` such that ``a`` and ``b`` agree on their first (``from_end``: last)
    ``k`` characters. Galloping, then a binary search inside the last step, on substring
    comparisons (memcmp speed): the spans compared add up to about twice the answer, not
    log(n) times the text."""
    lo, step = 0, 64
    while lo < n:  # they agree on 0..lo: extend by doubling steps
        hi = min(n, lo + step)
        if not _same(a, b, lo, hi, from_end):
            hi -= 1
            break
        lo, step = hi, step * 2
    else:
        return n
    while lo < hi:  # the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        if _same(a, b, lo, mid, from_end):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _same(a: str, b: str, lo: int, hi: int, from_end: bool) -> bool:
    """``a`` and ``b`` agree on the span ``lo..hi``, counted from their starts (or ends). Slices,
    not ``startswith``: a slice takes the narrowest kind its characters allow, so equal spans
    compare by memcmp, where ``startswith`` of a wide text with a narrow span compares
    character by character."""
    if from_end:
        la, lb = len(a), len(b)
        return a[la - hi : la - lo] == b[lb - hi : lb - lo]
    return a[lo:hi] == b[lo:hi]


def _token_char(c: str) -> bool:
    return c.isalnum() or c in _TOKEN_PUNCT


def _shape(text: str) -> str:
    out = []
    n = len(text)
    for i, c in enumerate(text):
        if c.isdigit():
            out.append("d")
        elif c.isalpha():
            before = text[i - 1] if i else ""
            after = text[i + 1] if i + 1 < n else ""
            lone = not before.isalpha() and not after.isalpha()
            marker = "A" <= c <= "Z" and lone and (before.isdigit() or after.isdigit())
            out.append(c if marker else "a")
        else:
            out.append(c)
    return "".join(out)


def _hint(text: str, shape: str) -> str:
    """A regex for ``shape``: runs of digits / letters / mixed alphanumerics, whitespace, literals."""
    parts: list[str] = []
    i, n = 0, len(shape)
    while i < n:
        c = shape[i]
        if c in "da":
            j = i
            while j < n and shape[j] in "da":
                j += 1
            run = shape[i:j]
            letters = text[i:j]
            if "a" not in run:
                cls = r"\d"
            elif "d" not in run:
                cls = "[A-Za-z]" if letters.isascii() else r"[^\W\d_]"
            else:
                cls = "[0-9A-Za-z]" if letters.isascii() else r"\w"
            parts.append(f"{cls}{{{j - i}}}" if j - i > 1 else cls)
            i = j
        elif c.isspace():
            j = i
            while j < n and shape[j].isspace():
                j += 1
            parts.append(r"\s+")
            i = j
        else:
            parts.append("\\" + c if c in _REGEX_SPECIAL else c)
            i += 1
    return "".join(parts)


def span_of(client: str, stored: str, depth: int) -> Span | None:
    """The first differing region of ``client`` against ``stored``, widened to its whole token."""
    if client == stored:
        return None
    p = _common_prefix(client, stored)
    s = _common_suffix(client, stored, min(len(client), len(stored)) - p)
    start, end = p, len(client) - s
    # Widen to the token around the change: "10:0[5:13]Z" is a timestamp, not "5:13". A pure
    # deletion is widened only when it falls inside a token ("10:|5"), not between words.
    inside = (
        0 < start < len(client) and _token_char(client[start - 1]) and _token_char(client[start])
    )
    if end > start or inside:
        while start > 0 and _token_char(client[start - 1]):
            start -= 1
        while end < len(client) and _token_char(client[end]):
            end += 1
    # ... but not over sentence punctuation that merely follows it.
    while end > max(start, len(client) - s) and client[end - 1] in ".:":
        end -= 1
    region = client[start:end]
    if len(region) > _MAX_SHAPE:
        shape = _shape(region[:_MAX_SHAPE]) + "…"
        return Span(depth=depth, offset=start, length=end - start, shape=shape, hint="")
    shape = _shape(region)
    hint = _hint(region, shape) if region else ""
    return Span(depth=depth, offset=start, length=end - start, shape=shape, hint=hint)


# -- texts to compare ------------------------------------------------------------------------


def _text(msg: Any) -> str | None:
    if type(msg) is not dict:
        return None
    content = msg.get("content")
    if type(content) is str:
        return content
    if type(content) is list:
        return "\n".join(p["text"] for p in content if is_text_part(p))
    return None


def _json_text(element: Any) -> str:
    try:
        return orjson.dumps(element, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return repr(element)


def _diff_texts(client: Any, stored: Any) -> tuple[str, str]:
    """The texts to diff: the content texts when they differ, else the sorted-keys JSON of the messages."""
    a, b = _text(client), _text(stored)
    if a is not None and b is not None and a != b:
        return a, b
    return _json_text(client), _json_text(stored)


def _tools_text(tools: Any) -> str:
    if type(tools) is not list:
        return _json_text(tools)

    def name(d: Any) -> str:
        if type(d) is dict:
            f = d.get("function")
            n = f.get("name") if type(f) is dict else d.get("name")
            if isinstance(n, str):
                return n
        return ""

    defs = sorted(tools, key=lambda d: (name(d), canonical_tool_definition(d)))
    return "[" + ",".join(canonical_tool_definition(d).decode() for d in defs) + "]"


def _similarity(a: str, b: str) -> int:
    p = _common_prefix(a, b)
    return p + _common_suffix(a, b, min(len(a), len(b)) - p)


def _reasoning_scan(body: bytes) -> bool:
    """Whether a stored body can have a reasoning key: one of their names (as a JSON string's
    start), or any ``\\u`` escape (a key could be spelled with one). False is exact."""
    # Substring searches run at memory speed; a regex alternation tries every quote in turn.
    return (
        b'"reasoning' in body
        or b'"thinking' in body
        or b'"thought_signature"' in body
        or b'"encrypted_content"' in body
        or b"\\u" in body
    )


class _BodyMemo:
    """A function of a stored body, remembered by the body, least recently used out beyond
    ``max_bytes`` of bodies. A store hands out the same body object on every read and bytes
    keep their hash, so a lookup costs a dict probe. A new session is diagnosed against the
    same siblings as the one before it, so without the memo every new session would scan and
    parse the same newest siblings again."""

    def __init__(self, of: Callable[[bytes], Any], max_bytes: int) -> None:
        self._of = of
        self._max_bytes = max_bytes
        self._bytes = 0
        self._known: OrderedDict[bytes, Any] = OrderedDict()

    def __call__(self, body: bytes) -> Any:
        known = self._known.get(body, _UNKNOWN)
        if known is not _UNKNOWN:
            self._known.move_to_end(body)
            return known
        value = self._known[body] = self._of(body)
        self._bytes += len(body)
        while self._bytes > self._max_bytes:
            self._bytes -= len(self._known.popitem(last=False)[0])
        return value


_UNKNOWN: Final = object()


def _parse(body: bytes) -> Any:
    """A stored body parsed (None when it is not JSON: a damaged entry). Read only: the memo
    hands the same object to every diagnosis."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


_may_hold_reasoning = _BodyMemo(_reasoning_scan, 8 << 20)
_parsed = _BodyMemo(_parse, 8 << 20)


def _load(node: Node) -> Any:
    return _parsed(node.body)


# -- diagnosis -------------------------------------------------------------------------------


def _role_kind(role: Any) -> Any:
    """Roles compared as one: a developer message folded into a system one is a system change."""
    return "system" if isinstance(role, str) and role in _SYSTEM_ROLES else role


def _without_reasoning(msg: Any) -> Any:
    if type(msg) is dict:
        return {k: v for k, v in msg.items() if k not in REASONING_KEYS}
    return msg


def _forwarded_message(body: Mapping[str, Any], match: Match, depth: int) -> Any:
    messages = body.get("messages")
    if type(messages) is not list or not 1 <= depth <= len(match.order):
        return None
    return messages[match.order[depth - 1]]


def _closest(client: Any, candidates: Sequence[tuple[Node, Any]]) -> Any:
    best, best_score = None, -1
    for _node, stored in candidates:
        a, b = _diff_texts(client, stored)
        score = _similarity(a, b)
        if score > best_score:
            best, best_score = stored, score
    return best


def _continues_deeper(store: NodeReader, match: Match, k: int, nodes: Sequence[Node]) -> bool:
    """Element k sits deeper in a stored chain, and element k+1 (if any) follows it there."""
    nxt = match.identities[k + 1] if k + 1 < len(match.identities) else None
    for node in nodes:
        if node.depth <= k:
            continue
        if nxt is None or store.get(chain(node.key, nxt)) is not None:
            return True
    return False


def _descends(store: NodeReader, nodes: Sequence[Node], ancestor: bytes, depth: int) -> bool:
    """One of ``nodes`` lies below ``ancestor`` (at ``depth``), at least two levels down."""
    budget = _MAX_WALK
    for node in nodes:
        if node.depth < depth + 2:
            continue
        cur: Node | None = node
        while cur is not None and cur.depth > depth + 1 and budget > 0:
            budget -= 1
            cur = store.get(cur.parent)
        if cur is not None and cur.depth == depth + 1 and cur.parent == ancestor:
            return True
        if budget <= 0:
            return False
    return False


def diagnose(body: Mapping[str, Any], match: Match, store: NodeReader) -> Break | None:
    """Why the request left the stored tree; None when all of it is stored.

    The rules of the module docstring are tried in their order; the first that holds wins."""
    k = match.matched
    if k >= len(match.keys):
        return None
    parent = match.keys[k - 1] if k else match.root
    # The newest siblings: a retry or an edit is compared with what was sent last.
    children = list(store.children(parent)[-_MAX_CANDIDATES:])
    if not children:
        return Break(reason="new_branch", depth=k)
    if k == 0:
        return _tools_break(body, children)

    msg = _forwarded_message(body, match, k)
    ident = match.identities[k]
    role = msg.get("role") if type(msg) is dict else None
    if k >= 2 and ident == match.identities[k - 1]:
        return Break(reason="duplicate_replay", depth=k)

    kind = _role_kind(role)
    # Stored siblings are parsed only when a rule needs their bodies: a new turn under a busy
    # prefix (thousands of sibling sessions) is told apart by roles and keys alone.
    if kind == "system":
        same_role = [c for c in children if _role_kind(c.role) == kind]
    else:
        same_role = [c for c in children if c.role == role]
    if _reasoning_changed(msg, ident, same_role, match.policy):
        return Break(reason="reasoning_changed", depth=k)
    elsewhere = _stored_elsewhere(store, match, parent, children)
    if elsewhere is not None:
        return Break(reason=elsewhere, depth=k)
    return _changed(msg, role, match, same_role)


def _tools_break(body: Mapping[str, Any], children: list[Node]) -> Break:
    """Rule 2: the request left the tree at its tools (``children``: the stored tools values
    under the tenant root), compared with the most similar of them."""
    stored_tools = [_load(c) for c in children]
    client = _tools_text(body.get("tools") or [])
    best, best_score = "", -1
    for text in [_tools_text(t if t is not None else []) for t in stored_tools]:
        score = _similarity(client, text)
        if score > best_score:  # the first of the most similar
            best, best_score = text, score
    return Break(reason="tools_changed", depth=0, span=span_of(client, best, 0))


def _reasoning_changed(msg: Any, ident: bytes, same_role: list[Node], policy: Policy) -> bool:
    """Rule 4: a stored sibling of the same role is the client's message but for its reasoning.

    A sibling without reasoning keys is compared only when the client's message has some: else
    both identities are computed from the same fields and the sibling's key would have matched."""
    check_all = type(msg) is dict and not REASONING_KEYS.isdisjoint(msg)
    if not check_all and not any(_may_hold_reasoning(c.body) for c in same_role):
        return False
    bare = message_identity(_without_reasoning(msg), policy) if check_all else ident
    for c in same_role:
        if check_all or _may_hold_reasoning(c.body):
            if message_identity(_without_reasoning(_load(c)), policy) == bare:
                return True
    return False


def _stored_elsewhere(store: NodeReader, match: Match, parent: bytes, children: list[Node]) -> str | None:
    """Rules 5 to 7, for element ``k = match.matched >= 1`` under ``parent`` (its stored
    ``children``): the request's messages are stored, but elsewhere in the chain -- its head
    cut off, a message skipped, or one added. None when none of them holds."""
    k = match.matched
    ident = match.identities[k]
    same_all = store.by_identity(match.root, ident)
    same_elsewhere = same_all[-_MAX_DEEPER:]
    if k == 1 and _continues_deeper(store, match, k, same_elsewhere):
        # The request's first message sits deeper in a stored chain: the head was cut off.
        return "truncated_head"
    # A grandchild with this identity is among the tenant's nodes of this identity: none, no probe.
    if (same_all and any(store.get(chain(c.key, ident)) is not None for c in children)) or _descends(
        store, same_elsewhere, parent, k - 1
    ):
        return "message_removed"
    if (
        k + 1 < len(match.identities)
        and store.get(chain(parent, match.identities[k + 1])) is not None
    ):
        return "message_inserted"
    return None


def _changed(msg: Any, role: Any, match: Match, same_role: list[Node]) -> Break:
    """Rules 8 to 11, for element ``k = match.matched >= 1`` (``msg``, of ``role``) against its
    stored siblings of the same role (``same_role``), once no rule before holds."""
    k = match.matched
    if not same_role or (role == "user" and k == len(match.keys) - 1):
        # Nothing of its kind stored here, or a new user turn at the end of the request: whatever
        # its siblings say, nothing after it could have been cached. A new turn, not a break.
        return Break(reason="new_branch", depth=k)

    loaded = [(c, _load(c)) for c in same_role]
    if _role_kind(role) == "system":
        a, b = _diff_texts(msg, _closest(msg, loaded))
        return Break(reason="system_changed", depth=k, span=span_of(a, b, k))

    if role == "assistant" and any(c.generated for c in same_role):
        return Break(reason="assistant_modified", depth=k)

    a, b = _diff_texts(msg, _closest(msg, loaded))
    return Break(reason="content_changed", depth=k, span=span_of(a, b, k))
