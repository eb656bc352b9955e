"""The transcript data model: :class:`Node`, :class:`SessionTotals`, chain hashing and the reader protocol.

A transcript is a path in a tree. Element 0 of every request is the ``tools``
array (a pseudo-message with role ``"tools"``, present even when the request
has no tools), elements 1.. are the messages (or, for the Responses API, the
``instructions`` and the input items). Each element's node is keyed by its chain
hash ``c_i = H(c_{i-1} || identity_i)``; ``c_{-1}`` is the tenant root (an HMAC of
the credential), so tenants never share nodes and a key names a whole prefix:
nodes are content-addressed and immutable.

The core owns this model; the stores (``proxy.store``) import it, never the reverse.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from .reader import NodeReader

__all__ = ["ROLE_TOOLS", "Node", "NodeReader", "SessionTotals", "TurnWrite", "chain", "tenant_root"]


def tenant_root(secret: bytes, credential: str) -> bytes:
    """``c_{-1}`` of a tenant: HMAC-SHA256(secret, credential), 16 bytes. ``""`` is the anonymous tenant."""
    mac = hmac.new(secret, credential.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return mac.digest()[:16]


def chain(parent: bytes, identity: bytes) -> bytes:
    """``c_i = H(c_{i-1} || id_i)``."""
    return hashlib.blake2b(parent + identity, digest_size=16).digest()


ROLE_TOOLS = "tools"
"""Role of the pseudo-element 0 that holds a request's ``tools`` array."""


@dataclass(init=False, unsafe_hash=True)  # built per request (proxy/core/values.py)
class Node:
    """One element of a stored transcript, in the canonical form the provider first saw."""

    key: Final[bytes]
    """Chain hash of this element (16 bytes)."""
    parent: Final[bytes]
    """Chain hash of the previous element; the tenant root for element 0."""
    tenant: Final[bytes]
    """The tenant root (keyed hash of the credential; never the raw credential)."""
    depth: Final[int]
    """Position in the request: 0 = the tools pseudo-element, 1.. = messages[depth - 1]."""
    role: Final[str]
    """``"tools"`` or the message role."""
    identity: Final[bytes]
    """Identity of the element (16 bytes): ``key == chain(parent, identity)``."""
    body: Final[bytes]
    """Canonical JSON (orjson) of the element as forwarded upstream, or as generated:
    the message object, or for role ``"tools"`` the tools array (``[]`` when absent)."""
    tokens: Final[int]
    """Token count of ``body`` (tiktoken cl100k), computed once when the node is created; 0 until then."""
    generated: Final[bool]
    """An assistant reply kvwarm observed from the upstream (its body is the generated strings)."""
    partial: Final[bool]
    """A generated reply whose stream ended before completion (what the client was delivered)."""
    created: Final[float]
    """Unix time of creation."""

    def __init__(
        self,
        *,
        key: bytes,
        parent: bytes,
        tenant: bytes,
        depth: int,
        role: str,
        identity: bytes,
        body: bytes,
        tokens: int = 0,
        generated: bool = False,
        partial: bool = False,
        created: float = 0.0,
    ) -> None:
        self.key = key
        self.parent = parent
        self.tenant = tenant
        self.depth = depth
        self.role = role
        self.identity = identity
        self.body = body
        self.tokens = tokens
        self.generated = generated
        self.partial = partial
        self.created = created

    def with_tokens(self, tokens: int) -> Node:
        """This node with its token count (``dataclasses.replace`` costs some 50 times the
        constructor, and this runs for every node counted after its write)."""
        return Node(
            key=self.key, parent=self.parent, tenant=self.tenant, depth=self.depth, role=self.role,
            identity=self.identity, body=self.body, tokens=tokens, generated=self.generated,
            partial=self.partial, created=self.created,
        )


@dataclass(init=False)  # built per request (proxy/core/values.py)
class SessionTotals:
    """Running totals of one session (a leaf path); they move down to the new leaf as a path grows."""

    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Only from responses that reported a cached count; see ``unknown_cache_turns``."""
    completion_tokens: int = 0
    unknown_cache_turns: int = 0
    """Turns whose response did not say how many prompt tokens were cached."""
    cost_usd: float = 0.0
    billed: bool = False
    """True when any of the cost was billed by the provider rather than estimated."""
    repaired: int = 0
    last_break: str = ""
    model: str = ""
    created: float = 0.0
    updated: float = 0.0

    def __init__(
        self,
        *,
        turns: int = 0,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        completion_tokens: int = 0,
        unknown_cache_turns: int = 0,
        cost_usd: float = 0.0,
        billed: bool = False,
        repaired: int = 0,
        last_break: str = "",
        model: str = "",
        created: float = 0.0,
        updated: float = 0.0,
    ) -> None:
        self.turns = turns
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.completion_tokens = completion_tokens
        self.unknown_cache_turns = unknown_cache_turns
        self.cost_usd = cost_usd
        self.billed = billed
        self.repaired = repaired
        self.last_break = last_break
        self.model = model
        self.created = created
        self.updated = updated


@dataclass(init=False, unsafe_hash=True)  # built per request (proxy/core/values.py)
class TurnWrite:
    """One turn to record: computed purely from the plan and the reply, written by the store."""

    nodes: Final[Sequence[Node]]
    """New nodes, parents first (request elements past the matched prefix, then the reply)."""
    path: Final[Sequence[bytes]]
    """The matched prefix's keys, root first: touched (TTL/LRU), and searched from the deepest
    for the previous session leaf whose totals move down to the new leaf."""
    leaf: Final[bytes]
    """The session's new leaf (the reply's key, or the request's last element)."""
    totals: Final[SessionTotals]
    """This turn's numbers, added to the session's running totals."""
    now: Final[float]
    tenant: Final[bytes]
    """The tenant root (a shared store keys a tenant's data by it); ``b""`` when not given."""

    def __init__(
        self,
        *,
        nodes: Sequence[Node],
        path: Sequence[bytes],
        leaf: bytes,
        totals: SessionTotals,
        now: float,
        tenant: bytes = b"",
    ) -> None:
        self.nodes = nodes
        self.path = path
        self.leaf = leaf
        self.totals = totals
        self.now = now
        self.tenant = tenant
