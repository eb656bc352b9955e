"""Chain hashes and matching a request against the transcript tree.

Element 0 of a request is its ``tools`` array, elements 1.. its messages. Each element's
key is ``chain(parent_key, identity)``, rooted in the tenant (:func:`tenant_root`), so a
key names the whole prefix that ends with the element. The matched prefix is the longest
run of leading keys the store holds.

Two things may change the order in which messages are forwarded (only when the policy
allows rewriting):

* a tool-result group (the contiguous ``tool`` messages after an assistant message with
  tool calls) sent in another order than stored is matched, and forwarded, in the stored
  order -- as a whole group or not at all;
* with ``collapse_duplicates``, an exact replay of the previous message is dropped.

:attr:`Match.order` records both: forwarded position -> request message index.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from sys import intern
from typing import Any, Final

import orjson

from .identity import IdentityMemo, identify_message, identify_messages, tight, tools_identity
from .model import ROLE_TOOLS, Node, NodeReader, chain, tenant_root
from .policy import Policy

__all__ = ["Match", "chain", "match_request", "new_nodes", "tenant_root", "tool_groups"]

_PERMUTATION_BUDGET = 256
"""Most store lookups spent looking for the stored order of one tool-result group."""
_DEFAULT_POLICY: Final = Policy()


@dataclass(init=False, unsafe_hash=True)  # built per request (proxy/core/values.py)
class Match:
    """Where a request stands in the tree. Every per-element tuple is in *forwarded* order."""

    root: Final[bytes]
    """The tenant root."""
    identities: Final[tuple[bytes, ...]]
    """Identity per forwarded element (0 = tools)."""
    keys: Final[tuple[bytes, ...]]
    """Chain hash per forwarded element."""
    order: Final[tuple[int, ...]]
    """Forwarded message position -> request message index (identity permutation when nothing moved)."""
    matched: Final[int]
    """Elements ``0 .. matched-1`` are stored."""
    nodes: Final[tuple[Node, ...]]
    """The stored nodes of the matched prefix (``len == matched``)."""
    policy: Final[Policy]
    """The policy the identities were computed with (new nodes and diagnosis must use the same)."""
    clean_sizes: Final[tuple[int, ...]]
    """Per forwarded element: ``len(orjson.dumps(element))`` when it needed no normalization, else -1.
    Lets repair prove "unchanged" without serializing the element again."""
    dumped: Final[tuple[bytes | None, ...]]
    """Per forwarded element (when an identity memo was used): its ``orjson.dumps`` bytes, or None."""
    message_ids: Final[tuple[bytes, ...]]
    """Per *request* message (the client's order, collapsed duplicates included): its identity."""
    message_sizes: Final[tuple[int, ...]]
    """Per request message: its clean size (see ``clean_sizes``)."""
    message_dumped: Final[tuple[bytes | None, ...]]
    """Per request message (when an identity memo was used): its ``orjson.dumps`` bytes, or None
    (also for a message the memo recognised as an object it holds)."""
    clean: Final[int]
    """Leading messages a previous plan of these very objects found forwarding their stored
    bytes (:class:`KnownPrefix`): repair need not compare them again."""
    tools_clean: Final[bool]
    """The ``tools`` value is the very object a previous plan found forwarding its stored bytes."""
    ordered: Final[bool]
    """Known to forward every request message in place (``order`` is ``0 .. n-1``); False: look at ``order``."""

    def __init__(
        self,
        *,
        root: bytes,
        identities: tuple[bytes, ...],
        keys: tuple[bytes, ...],
        order: tuple[int, ...],
        matched: int,
        nodes: tuple[Node, ...],
        policy: Policy = _DEFAULT_POLICY,
        clean_sizes: tuple[int, ...] = (),
        dumped: tuple[bytes | None, ...] = (),
        message_ids: tuple[bytes, ...] = (),
        message_sizes: tuple[int, ...] = (),
        message_dumped: tuple[bytes | None, ...] = (),
        clean: int = 0,
        tools_clean: bool = False,
        ordered: bool = False,
    ) -> None:
        self.root = root
        self.identities = identities
        self.keys = keys
        self.order = order
        self.matched = matched
        self.nodes = nodes
        self.policy = policy
        self.clean_sizes = clean_sizes
        self.dumped = dumped
        self.message_ids = message_ids
        self.message_sizes = message_sizes
        self.message_dumped = message_dumped
        self.clean = clean
        self.tools_clean = tools_clean
        self.ordered = ordered

    @property
    def matched_messages(self) -> int:
        """Messages inside the matched prefix (the tools element 0 is not a message)."""
        return max(self.matched - 1, 0)

    @property
    def complete(self) -> bool:
        """The whole request is stored."""
        return self.matched == len(self.keys)


@dataclass(init=False, unsafe_hash=True)  # built per request (proxy/core/values.py)
class KnownPrefix:
    """How the first messages of a body re-sent byte for byte were matched the turn before.

    :mod:`proxy.core.prefix` rebuilds such a body from a remembered one: its first ``messages``
    are the very objects that body held, with the same tools value, so their identities and
    chain keys are the remembered ``match``'s. Matching starts after them, provided they were
    matched in order and the deepest of them is still stored (a parent is never evicted before
    its children). The work of a re-sent turn is then proportional to its new messages.
    """

    messages: Final[int]
    """Request messages ``0 .. messages-1`` are the remembered body's."""
    match: Final[Match]
    """The remembered body's match (its ``root`` and ``policy`` must be this request's)."""
    clean: Final[int]
    """Of them, the leading ones its plan found needing no repair."""
    tools: Final[Any]
    """The remembered body's ``tools`` value (the very object)."""
    held: Final[Sequence[Any]]
    """The remembered body's messages (the very objects)."""
    tools_clean: Final[bool]
    """Its plan found the ``tools`` value needing no repair."""

    def __init__(
        self,
        *,
        messages: int,
        match: Match,
        clean: int,
        tools: Any,
        held: Sequence[Any],
        tools_clean: bool = False,
    ) -> None:
        self.messages = messages
        self.match = match
        self.clean = clean
        self.tools = tools
        self.held = held
        self.tools_clean = tools_clean

    def usable(self, body: Mapping[str, Any], root: bytes, policy: Policy) -> int:
        """How many leading messages of ``body`` can be taken as matched (0: none)."""
        m = self.match
        k = min(self.messages, m.matched - 1, len(self.held))
        if k <= 0 or m.root != root or (m.policy is not policy and m.policy != policy) or body.get("tools") is not self.tools:
            return 0
        if len(m.message_ids) < k or not (m.ordered or in_order(m.order, k)):
            return 0  # something before it moved or was collapsed: match it all again
        return k


def in_order(order: Sequence[int], k: int) -> bool:
    """The first ``k`` forwarded messages are the request's first ``k``, in place (none moved
    or collapsed before there)."""
    return len(order) >= k and tuple(order[:k]) == tuple(range(k))


def tool_groups(messages: Sequence[Any]) -> dict[int, int]:
    """Tool-result groups: start index -> end index (exclusive) of each run of ``tool`` messages
    that follows an assistant message with tool calls."""
    groups: dict[int, int] = {}
    n = len(messages)
    i = 0
    while i < n:
        msg = messages[i]
        i += 1
        if type(msg) is dict and msg.get("role") == "assistant" and msg.get("tool_calls"):
            j = i
            while j < n and type(messages[j]) is dict and messages[j].get("role") == "tool":
                j += 1
            if j > i:
                groups[i] = j
                i = j
    return groups


def _group_around(messages: Sequence[Any], i: int) -> tuple[int, int] | None:
    """The tool-result group (start, end) holding message ``i``, when it has two members or more."""

    def is_tool(j: int) -> bool:
        m = messages[j]
        return type(m) is dict and m.get("role") == "tool"

    if not is_tool(i):
        return None
    start = i
    while start > 0 and is_tool(start - 1):
        start -= 1
    if start == 0:
        return None
    head = messages[start - 1]
    if not (type(head) is dict and head.get("role") == "assistant" and head.get("tool_calls")):
        return None
    end = i + 1
    while end < len(messages) and is_tool(end):
        end += 1
    return (start, end) if end - start > 1 else None


def _collapsible(msg: Any) -> bool:
    if type(msg) is not dict:
        return False
    role = msg.get("role")
    return role != "tool" and not (role == "assistant" and msg.get("tool_calls"))


def _stored_order(
    parent: bytes, members: list[int], ids: Sequence[bytes], store: NodeReader
) -> list[tuple[int, bytes, Node]] | None:
    """The stored order of a whole tool-result group under ``parent``, preferring the request's
    order at each step (depth-first, bounded); None when no stored path holds the whole group."""
    path: list[tuple[int, bytes, Node]] = []
    budget = _PERMUTATION_BUDGET

    def walk(parent: bytes, remaining: list[int]) -> bool:
        nonlocal budget
        if not remaining:
            return True
        tried: set[bytes] = set()
        for pos, r in enumerate(remaining):
            if ids[r] in tried:
                continue
            tried.add(ids[r])
            if budget <= 0:
                return False
            budget -= 1
            key = chain(parent, ids[r])
            node = store.get(key)
            if node is None:
                continue
            path.append((r, key, node))
            if walk(key, remaining[:pos] + remaining[pos + 1 :]):
                return True
            path.pop()
        return False

    return path if walk(parent, members) else None


def _regroup(
    group: tuple[int, int],
    i: int,
    msg_ids: Sequence[bytes],
    store: NodeReader,
    order: list[int],
    keys: list[bytes],
    nodes: list[Node],
) -> bool:
    """Look for the whole tool-result group ``group`` (left at message ``i``) in its stored order,
    starting over from the group's parent; on success rewrite the tails of ``order``, ``keys`` and
    ``nodes`` in place."""
    start, end = group
    kept = len(order) - (i - start)
    found = _stored_order(keys[kept], list(range(start, end)), msg_ids, store)
    if found is None:
        return False
    del order[kept:], keys[kept + 1 :], nodes[kept + 1 :]
    for r, key, node in found:
        order.append(r)
        keys.append(key)
        nodes.append(node)
    return True


def match_request(
    body: Mapping[str, Any],
    root: bytes,
    store: NodeReader,
    policy: Policy,
    memo: IdentityMemo | None = None,
    known: KnownPrefix | None = None,
) -> Match:
    """Identify every element, chain the keys and find the longest stored prefix.

    ``memo`` (optional, one per policy) remembers identities by exact message bytes; ``known``
    (with a memo) gives the match of the body's leading messages, as planned the turn before.
    """
    raw_messages = body.get("messages")
    messages: list[Any] = raw_messages if type(raw_messages) is list else []
    n = len(messages)
    get = store.get
    if known is not None and memo is not None:
        k = known.usable(body, root, policy)
        if 0 < k <= n and messages[k - 1] is known.held[k - 1] and get(known.match.keys[k]) is not None:
            return _match_after(messages, known.match, k, known.clean, store, policy, memo, known.tools_clean)

    dumped: list[bytes | None] | None = [] if memo is not None else None
    msg_ids, sizes = identify_messages(messages, policy, memo, dumped)

    blake2b = hashlib.blake2b
    tools = body.get("tools")
    tools_id = memo.tools_identity(tools) if memo is not None else tools_identity(tools)
    # Elements of a remembered body (:mod:`proxy.core.prefix`) carry their last chain step.
    step = memo._objects.get(id(tools)) if memo is not None else None
    if step is not None and step.obj is tools and step.parent == root and step.key is not None:
        parent = step.key
    else:
        parent = blake2b(root + tools_id, digest_size=16).digest()
    node = get(parent)
    nodes: list[Node] = [node] if node is not None else []
    return _chain(messages, 0, [parent], nodes, [], node is not None, msg_ids, sizes, dumped, tools_id, root, store, policy, memo, 0)


def _match_after(
    messages: list[Any],
    before: Match,
    k: int,
    clean: int,
    store: NodeReader,
    policy: Policy,
    memo: IdentityMemo | None,
    tools_clean: bool = False,
) -> Match:
    """:func:`match_request` for a body whose first ``k`` messages ``before`` matched in order
    (and with the same ``tools`` object: ``tools_clean`` when it needed no repair then)."""
    dumped: list[bytes | None] | None = list(before.message_dumped[:k]) if memo is not None else None
    if dumped is not None and len(dumped) < k:
        dumped = None
    new_ids, new_sizes = identify_messages(messages[k:], policy, memo, dumped)
    msg_ids = [*before.message_ids[:k], *new_ids]
    sizes = [*before.message_sizes[:k], *new_sizes]
    return _chain(
        messages, k, list(before.keys[: k + 1]), list(before.nodes[: k + 1]), list(range(k)), True,
        msg_ids, sizes, dumped, before.identities[0], before.root, store, policy, memo, min(clean, k), tools_clean,
    )


def _chain(
    messages: list[Any],
    i: int,
    keys: list[bytes],
    nodes: list[Node],
    order: list[int],
    matching: bool,
    msg_ids: list[bytes],
    sizes: list[int],
    dumped: list[bytes | None] | None,
    tools_id: bytes,
    root: bytes,
    store: NodeReader,
    policy: Policy,
    memo: IdentityMemo | None,
    clean: int,
    tools_clean: bool = False,
) -> Match:
    """Chain the keys of ``messages[i:]`` after ``keys`` (the elements before, ``order`` their
    message indices), matching while ``matching``; the :class:`Match` of the whole body.
    ``clean``: leading messages known to need no repair (while they keep their places). The
    elements before ``i`` are the request's first messages, in place."""
    shuffled = _extend(messages, i, keys, nodes, order, matching, msg_ids, store, policy, memo)
    if clean and shuffled and not in_order(order, clean):
        clean = 0  # a tool-result group was put back in its stored order from before there
    n = len(messages)
    ordered = not shuffled or (len(order) == n and in_order(order, n))
    if ordered:
        # Nothing moved or collapsed (the usual case): the forwarded order is the request's.
        identities, clean_sizes = (tools_id, *msg_ids), (-1, *sizes)
        forwarded_dumped = (None, *dumped) if dumped is not None else ()
    else:
        identities = (tools_id, *[msg_ids[r] for r in order])
        clean_sizes = (-1, *[sizes[r] for r in order])
        forwarded_dumped = (None, *[dumped[r] for r in order]) if dumped is not None else ()
    return Match(
        root=root,
        identities=identities,
        keys=tuple(keys),
        order=tuple(order),
        matched=len(nodes),
        nodes=tuple(nodes),
        policy=policy,
        clean_sizes=clean_sizes,
        dumped=forwarded_dumped,
        message_ids=tuple(msg_ids),
        message_sizes=tuple(sizes),
        message_dumped=tuple(dumped) if dumped is not None else (),
        clean=clean,
        tools_clean=tools_clean,
        ordered=ordered,
    )


def _extend(
    messages: list[Any], i: int, keys: list[bytes], nodes: list[Node], order: list[int], matching: bool,
    msg_ids: list[bytes], store: NodeReader, policy: Policy, memo: IdentityMemo | None,
) -> bool:
    """For each message of ``messages[i:]`` forwarded (a collapsed replay is not), append its
    chain key to ``keys``, its index to ``order`` and, while the store holds them (``matching``),
    its node to ``nodes``: ``keys`` stays one longer than ``order`` (element 0 is the tools), and
    ``nodes`` holds the nodes of a leading run of ``keys``. True when the forwarded order is not
    the request's: a replay was collapsed, or a tool-result group put back in its stored order
    (both only when the policy allows rewriting)."""
    n = len(messages)
    shuffled = False
    get = store.get
    blake2b = hashlib.blake2b
    held = memo._objects.get if memo is not None else None
    parent = keys[-1]
    rewrite = policy.repair
    collapse = rewrite and policy.collapse_duplicates

    while i < n:
        ident = msg_ids[i]
        if (
            collapse
            and i > 0
            and ident == msg_ids[i - 1]
            and _collapsible(messages[i])
            and _collapsible(messages[i - 1])
            # Keep a repeat the stored transcript itself holds: then it is no replay.
            and not (matching and get(chain(parent, ident)) is not None)
        ):
            shuffled = True
            i += 1
            continue
        step = held(id(messages[i])) if held is not None else None
        if step is not None and step.obj is messages[i] and step.parent == parent and step.key is not None:
            key = step.key
        else:
            key = blake2b(parent + ident, digest_size=16).digest()
        if matching:
            node = get(key)
            if node is not None:
                nodes.append(node)
            else:
                matching = False
                group = _group_around(messages, i) if rewrite else None
                if group is not None and _regroup(group, i, msg_ids, store, order, keys, nodes):
                    # Left the tree inside a tool-result group, found whole in the stored order.
                    shuffled = True
                    parent = keys[-1]
                    matching = True
                    i = group[1]
                    continue
        order.append(i)
        keys.append(key)
        parent = key
        i += 1
    return shuffled


def forwarded_elements(match: Match, forwarded: Mapping[str, Any]) -> list[Any]:
    """The elements of the forwarded body in forwarded order: the tools array (``[]`` when absent), then messages.

    ``forwarded`` is the repaired body, or the client's when nothing changed; either way its
    messages are already in forwarded order."""
    tools = forwarded.get("tools")
    messages = forwarded.get("messages")
    msgs = messages if type(messages) is list else []
    if len(msgs) != len(match.order):
        raise ValueError(f"forwarded body has {len(msgs)} messages, the match {len(match.order)}")
    return [tools if tools is not None else [], *msgs]


def new_nodes(
    match: Match,
    forwarded: Mapping[str, Any],
    replies: Sequence[Mapping[str, Any]],
    *,
    generated_partial: bool,
    now: float,
    count_tokens: Callable[[bytes], int],
    memo: IdentityMemo | None = None,
) -> list[Node]:
    """Nodes to insert after a successful exchange, parents first.

    One node per forwarded element at depth >= ``match.matched`` (body: the element as
    forwarded), then each generated reply element as generated (the first a child of the
    last element, each next one a child of the one before; ``generated=True``). Every body is
    a :func:`~proxy.core.identity.tight` copy. A new node's parent key and tenant are the very
    objects of the stored prefix's nodes where there are some (a store keeps those).

    ``memo`` (the identity memo the match was planned with): a reply's identity is looked up by
    its bytes, and remembered (the client re-sends the reply as its next turn's message).
    """
    out: list[Node] = []
    root = match.root
    stored = match.nodes
    tenant = stored[0].tenant if stored else root
    parent = stored[-1].key if stored else root
    if match.matched < len(match.keys):
        parent = _request_nodes(out, match, forwarded, tenant, parent, now, count_tokens)
    # The reply follows the request's last element (``parent`` now).
    _reply_nodes(out, match, replies, tenant, parent, generated_partial, now, count_tokens, memo)
    return out


def _request_nodes(
    out: list[Node], match: Match, forwarded: Mapping[str, Any], tenant: bytes, parent: bytes, now: float,
    count_tokens: Callable[[bytes], int],
) -> bytes:
    """Append to ``out`` a node per forwarded element past the matched prefix, the first a child
    of ``parent``; the key of the last (the request's last element)."""
    elements = forwarded_elements(match, forwarded)
    # Past the matched prefix the forwarded elements are the client's own (repair stops
    # there): the bytes identification serialized are theirs.
    keys = match.keys
    dumped = match.dumped
    identities = match.identities
    for depth in range(match.matched, len(keys)):
        element = elements[depth]
        data = dumped[depth] if depth < len(dumped) else None
        body = data if data is not None else tight(orjson.dumps(element))
        key = keys[depth]
        role = ROLE_TOOLS if depth == 0 else intern(_role(element))
        out.append(
            Node(
                key=key, parent=parent, tenant=tenant, depth=depth, role=role, identity=identities[depth],
                body=body, tokens=count_tokens(body), created=now,
            )
        )
        parent = key
    return parent


def _reply_nodes(
    out: list[Node], match: Match, replies: Sequence[Mapping[str, Any]], tenant: bytes, parent: bytes,
    partial: bool, now: float, count_tokens: Callable[[bytes], int], memo: IdentityMemo | None,
) -> None:
    """Append to ``out`` a generated node per reply message, each a child of the one before,
    the first of ``parent`` (the request's last element), at the depths after the request's."""
    depth = len(match.keys)
    lookup = memo.get if memo is not None else None
    policy = match.policy
    for message in replies:
        body = tight(orjson.dumps(message))
        hit = lookup(body) if lookup is not None else None
        if hit is None:
            hit = identify_message(message, policy)
            if memo is not None:
                memo.put(body, hit, copied=True)
        identity = hit[0]
        key = chain(parent, identity)
        out.append(
            Node(
                key=key, parent=parent, tenant=tenant, depth=depth, role=intern(_role(message) or "assistant"),
                identity=identity, body=body, tokens=count_tokens(body), generated=True, partial=partial,
                created=now,
            )
        )
        parent = key
        depth += 1


def _role(element: Any) -> str:
    if type(element) is dict:
        role = element.get("role")
        if isinstance(role, str):
            return role
    return ""
