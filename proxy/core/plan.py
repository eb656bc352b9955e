"""The turn planner: what to forward for one request, and what to record after it. Pure.

:func:`plan_turn` goes from (the parsed body, the tenant root, a store reader, the
policy, the identity memo) to a frozen :class:`TurnPlan`: the matched prefix, the
repairs, the break, and the body as forwarded. :func:`turn_write` goes from (the
plan, the reply as generated, the usage, the cost) to the store write of the turn:
new nodes and the session's totals. Neither does I/O nor reads a clock; the wire
front-ends (``proxy.wire``) add the bytes, the request path adds the I/O.

Each stage runs under the caller's guard (:mod:`proxy.core.guard`): a failed
match leaves the plan without match, repair or break, and the client's bytes go
upstream unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol

from .breakpoints import Tree
from .breaks import Break, diagnose
from .guard import STRICT, Guard
from .identity import IdentityMemo
from .match import KnownPrefix, Match, match_request, new_nodes
from .model import NodeReader, SessionTotals, TurnWrite
from .policy import Policy
from .pricing import Cost
from .record import Reply
from .repair import NO_REPAIR, RepairPlan, plan_repair
from .splice import Refusal, try_splice
from .usage import Usage

__all__ = ["PlannedView", "TurnPlan", "plan_turn", "turn_write"]


class PlannedView(Protocol):
    """A wire API's view of the client's re-sent array (see :attr:`TurnPlan.view`)."""

    @property
    def messages(self) -> list[Any]:
        """The view's messages, in order: what the match was planned on."""
        ...

    @property
    def spans(self) -> Sequence[tuple[int, ...]]:
        """Per message, the indices of the array elements it was made of."""
        ...

    @property
    def reused(self) -> int:
        """Leading messages that are the very objects of the previous turn's view."""
        ...


@dataclass(init=False, unsafe_hash=True)  # built per request (proxy/core/values.py)
class TurnPlan:
    """What kvwarm decided for one request before forwarding it."""

    root: Final[bytes]
    """The tenant root."""
    match: Final[Match | None]
    """The stored prefix the request continues (None: fingerprinting failed open)."""
    repair: Final[RepairPlan]
    """What was restored to the stored form (``NO_REPAIR`` when nothing)."""
    brk: Final[Break | None]
    """Where and why the request left the stored tree (a ``new_branch`` is no break)."""
    forwarded: Final[Mapping[str, Any]]
    """The body as forwarded, parsed: the repaired body, or the client's."""
    messages: Final[int]
    """Messages in the client's request."""
    spliced: Final[bytes | None]
    """The client's bytes with the repair spliced in (every other byte the client's); None when
    nothing was repaired or no raw bytes were given."""
    refused: Final[str]
    """Why a planned repair could not be spliced into the client's bytes (a
    :data:`~proxy.core.splice.REFUSALS` reason): the request is then planned and forwarded unrepaired."""
    clean: Final[int]
    """Leading matched messages repair compared with their stored bytes and left as they are
    (0 when repair is off or failed): the next turn need not compare them again."""
    tools_clean: Final[bool]
    """Repair compared the ``tools`` value with its stored bytes and left it as it is."""
    view: Final[PlannedView | None]
    """The messages planned on, when the wire API planned a view of the client's re-sent array
    rather than its elements (the Responses API's items as chat-shaped messages); None: the
    body's own ``messages``. Remembered with the body for the next turn (:mod:`proxy.core.prefix`)."""
    tree: Final[Tree | None]
    """What the store knows of the matched prefix for cache breakpoints (:mod:`proxy.core.breakpoints`):
    set only when the request's upstream takes markers; None: no markers are placed."""

    def __init__(
        self,
        *,
        root: bytes,
        match: Match | None,
        repair: RepairPlan,
        brk: Break | None,
        forwarded: Mapping[str, Any],
        messages: int,
        spliced: bytes | None = None,
        refused: str = "",
        clean: int = 0,
        tools_clean: bool = False,
        view: PlannedView | None = None,
        tree: Tree | None = None,
    ) -> None:
        self.root = root
        self.match = match
        self.repair = repair
        self.brk = brk
        self.forwarded = forwarded
        self.messages = messages
        self.spliced = spliced
        self.refused = refused
        self.clean = clean
        self.tools_clean = tools_clean
        self.view = view
        self.tree = tree

    def with_view(self, view: PlannedView) -> TurnPlan:
        """This plan, planned on ``view`` (``dataclasses.replace`` costs some 50 times the
        constructor, and every Responses API request comes here)."""
        return TurnPlan(
            root=self.root, match=self.match, repair=self.repair, brk=self.brk, forwarded=self.forwarded,
            messages=self.messages, spliced=self.spliced, refused=self.refused, clean=self.clean,
            tools_clean=self.tools_clean, view=view, tree=self.tree,
        )

    def with_tree(self, tree: Tree) -> TurnPlan:
        """This plan, with what the store knows for cache breakpoints."""
        return TurnPlan(
            root=self.root, match=self.match, repair=self.repair, brk=self.brk, forwarded=self.forwarded,
            messages=self.messages, spliced=self.spliced, refused=self.refused, clean=self.clean,
            tools_clean=self.tools_clean, view=self.view, tree=tree,
        )

    @property
    def matched_messages(self) -> int:
        return self.match.matched_messages if self.match is not None else 0

    @property
    def broke(self) -> Break | None:
        """The break, when it is one (a new turn is not)."""
        brk = self.brk
        return brk if brk is not None and brk.is_break else None


def plan_turn(
    body: Mapping[str, Any],
    root: bytes,
    reader: NodeReader,
    policy: Policy,
    memo: IdentityMemo | None = None,
    guard: Guard = STRICT,
    raw: bytes | None = None,
    known: KnownPrefix | None = None,
) -> TurnPlan:
    """Match ``body`` against the tree, plan its repair and diagnose its break. Never mutates ``body``.

    With the client's ``raw`` bytes, a repair is spliced into them; where that cannot keep every
    other byte's meaning (duplicate keys, numbers that would not survive), the request is planned
    again without repair (``refused`` says why). ``known``: how the body's leading messages were
    matched the turn before (a body re-sent byte for byte, :mod:`proxy.core.prefix`).
    """
    plan = _plan(body, root, reader, policy, memo, guard, known)
    if raw is None or not plan.repair.repairs:
        return plan
    spliced = try_splice(raw, plan.repair.edits)
    if isinstance(spliced, Refusal):
        plan = _plan(body, root, reader, replace(policy, repair=False), memo, guard)
        return replace(plan, refused=spliced.reason)
    return replace(plan, spliced=spliced)


def _plan(
    body: Mapping[str, Any],
    root: bytes,
    reader: NodeReader,
    policy: Policy,
    memo: IdentityMemo | None,
    guard: Guard,
    known: KnownPrefix | None = None,
) -> TurnPlan:
    match: Match | None = None
    repair = NO_REPAIR
    brk: Break | None = None
    # try/except rather than ``with guard(...)``: the same boundary at no cost (core/guard.py).
    try:
        match = match_request(body, root, reader, policy, memo, known)
    except Exception as exc:
        guard.fail("match", exc)
    clean = 0
    tools_clean = False
    if match is not None:
        try:
            repair = plan_repair(body, match, policy)
            if policy.repair:
                repairs = repair.repairs
                if not repairs:  # the usual case
                    clean = match.matched_messages
                    tools_clean = match.matched >= 1
                else:
                    repaired = [r.depth for r in repairs if r.depth >= 1]
                    clean = min(repaired) - 1 if repaired else match.matched_messages
                    tools_clean = match.matched >= 1 and all(r.depth != 0 for r in repairs)
        except Exception as exc:
            guard.fail("repair", exc)
        try:
            brk = diagnose(body, match, reader)
        except Exception as exc:
            guard.fail("diagnose", exc)
    messages = body.get("messages")
    return TurnPlan(
        root=root,
        match=match,
        repair=repair,
        brk=brk,
        forwarded=repair.body if repair.body is not None else body,
        messages=len(messages) if isinstance(messages, list) else 0,
        clean=clean,
        tools_clean=tools_clean,
    )


def turn_write(
    plan: TurnPlan,
    reply: Reply | None,
    usage: Usage | None,
    cost: Cost | None,
    *,
    model: str,
    client_gone: bool,
    now: float,
    count_tokens: Callable[[bytes], int] = len,
    memo: IdentityMemo | None = None,
) -> TurnWrite | None:
    """The nodes and session totals of a turn that was answered; None without a match.

    The reply is recorded as generated; when the client left mid-stream it is recorded
    as delivered (``partial``): what the client sends next is what its user saw. ``memo``:
    the identity memo the plan was made with (see :func:`~proxy.core.match.new_nodes`).
    """
    match = plan.match
    if match is None:
        return None
    replies = [m for m in reply.messages if _has_output(m)] if reply is not None else []
    drafts = new_nodes(
        match,
        plan.forwarded,
        replies,
        generated_partial=bool(reply is not None and (reply.partial or client_gone)),
        now=now,
        count_tokens=count_tokens,
        memo=memo,
    )
    leaf = drafts[-1].key if drafts else (match.keys[-1] if match.keys else None)
    if leaf is None:
        return None
    brk = plan.broke
    prompt = cached = completion = 0
    unknown_cache = 1
    if usage is not None:
        prompt = usage.prompt_tokens or 0
        cached = usage.cached_tokens or 0
        completion = usage.completion_tokens or 0
        unknown_cache = 1 if usage.cached_tokens is None else 0
    totals = SessionTotals(
        turns=1,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        unknown_cache_turns=unknown_cache,
        cost_usd=(cost.usd or 0.0) if cost else 0.0,
        billed=bool(cost and cost.billed),
        repaired=len(plan.repair.repairs),
        last_break=brk.reason if brk is not None else "",
        model=model,
        created=now,
        updated=now,
    )
    return TurnWrite(
        nodes=tuple(drafts), path=match.keys[: match.matched], leaf=leaf, totals=totals, now=now, tenant=match.root
    )


def _has_output(message: Mapping[str, Any]) -> bool:
    return any(message.get(k) for k in ("content", "tool_calls", "reasoning_content", "encrypted_content"))
