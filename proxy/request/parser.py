"""The wire API that understands a request, and its body parsed once, or only past what it re-sends.

An agent re-sends its whole conversation every turn. :meth:`Parser.parse` (the read step) first
looks for one of the tenant's recent bodies the request continues byte for byte
(:mod:`proxy.core.prefix`): its messages, identities and chain keys are reused and only the new
ones parsed. Else the first wire API that understands the request (:data:`~proxy.wire.WIRES`)
parses it whole; none: the request is forwarded untouched. :meth:`Parser.remember` (after the
response, with the report) keeps each planned body, where its messages are and what they are,
for the tenant's next turn. A rebuilt body always equals a full parse; on any doubt, the full
path.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..core.identity import IdentityMemo
from ..core.prefix import PrefixMemo, Recalled
from ..wire import WIRES
from ..wire.base import Wire
from .turn import Scope, Turn

__all__ = ["Parser"]


class Parser:
    """The wire APIs' parse of each request, and each tenant's recent bodies (module docstring)."""

    def __init__(self, memo: IdentityMemo) -> None:
        self.resent = PrefixMemo(memo)
        """Each tenant's recent bodies: a re-sent conversation is parsed only past what it shares."""

    def parse(
        self, request: web.Request, raw: bytes, scope: Scope
    ) -> tuple[Wire | None, dict[str, Any] | None, Recalled | None]:
        """The wire API that understands this request, and its parsed body: a conversation that
        continues one of the tenant's recent bodies is parsed only past what they share."""
        recalled = self.resent.recall(scope, raw)
        if recalled is not None:
            return recalled.tag, recalled.body, recalled
        for wire in WIRES:
            body = wire.parse(request.method, request.path, raw)
            if body is not None:
                return wire, body, None
        return None, None, None

    def remember(self, turn: Turn) -> None:
        """Keep the body, where its messages are and what they are, for the tenant's next turn."""
        wire, body, plan = turn.wire, turn.body, turn.plan
        if wire is None or body is None or plan is None or plan.match is None or wire.resends is None:
            return
        try:
            self.resent.remember_plan(turn.scope, turn.raw, body, plan, turn.recalled, tag=wire, array=wire.resends)
        except Exception as exc:
            turn.guard.fail("identify", exc)
