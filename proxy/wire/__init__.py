"""Wire APIs: one front-end (request planning) and one response observer per API.

:mod:`proxy.wire.chat` speaks ``/v1/chat/completions``, :mod:`proxy.wire.responses`
``/v1/responses``, :mod:`proxy.wire.messages` Anthropic's ``/v1/messages``. A new wire API adds
a module here implementing :class:`proxy.wire.base.Wire` and its entry in :data:`WIRES`; the
matcher, repair, store and break diagnosis are shared (``proxy.core``). Everything here is
pure: no aiohttp, no I/O.
"""

from __future__ import annotations

from .base import Wire
from .chat import ChatWire
from .messages import MessagesWire
from .responses import ResponsesWire

__all__ = ["WIRES"]

WIRES: tuple[Wire, ...] = (ChatWire(), ResponsesWire(), MessagesWire())
"""The wire APIs a request is offered to, in order: the first that parses it plans it."""
