"""``/v1/chat/completions``: the chat front-end and its response observer. Pure.

Front-end: a POST whose body is a JSON object with a ``messages`` list is a chat
turn (anything else passes untouched). The bytes forwarded are the client's own,
with a repair's values spliced in (:mod:`proxy.core.splice`), cache markers where the
upstream takes them (:mod:`proxy.wire.cache_marks`) and, for a stream that did not ask for
it, ``stream_options.include_usage`` added, so every stream reports usage; the observer
hides what that option caused. Nothing is ever re-serialized.

Observer: reads the usage from the body or from each chunk (merged), assembles the
reply exactly as generated (:mod:`proxy.core.record`), learns the upstream's traits
(llama.cpp ``timings``), and, when kvwarm injected ``include_usage``, hides the
usage-only chunk and strips the ``"usage": null`` member OpenAI-style upstreams then
add to every chunk, byte for byte otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson
from mypy_extensions import mypyc_attr

from ..core.breakpoints import Marks
from ..core.guard import Guard
from ..core.identity import IdentityMemo
from ..core.model import NodeReader
from ..core.plan import TurnPlan, plan_turn
from ..core.policy import Policy
from ..core.prefix import Recalled
from ..core.record import Reply, ReplyAssembler, reply_from_body
from ..core.splice import Edit, Insert, skip_space, splice
from ..core.splice import Replace as SetValue
from ..core.sse import SSEEvent, load_data
from ..core.usage import Usage, extract_usage, is_usage_only_chunk, merge_usage
from ..transport.traits import UpstreamTraits
from .base import HIDE, KEEP, BodyBuffer, Outgoing, Replace, Verdict, body_json, json_turn
from .cache_marks import ChatElements, with_breakpoints

__all__ = ["DONE", "ChatObserver", "ChatWire", "Outgoing", "without_null_usage"]

DONE = "[DONE]"
_DONE = DONE.encode()
PATH_SUFFIX = "/chat/completions"


@mypyc_attr(allow_interpreted_subclasses=True)  # the fail-open tests subclass it (proxy/native.py)
class ChatWire:
    """The Chat Completions API."""

    name = "chat"
    resends: str | None = "messages"
    """The array a client re-sends every turn (:mod:`proxy.core.prefix`)."""

    def parse(self, method: str, path: str, raw: bytes) -> dict[str, Any] | None:
        """The request body when this is a chat turn kvwarm understands; else None (forwarded untouched)."""
        return json_turn(method, path, PATH_SUFFIX, raw, "messages")

    def plan(
        self,
        raw: bytes,
        body: Mapping[str, Any],
        root: bytes,
        reader: NodeReader,
        policy: Policy,
        memo: IdentityMemo | None,
        guard: Guard,
        recalled: Recalled | None = None,
    ) -> TurnPlan:
        """``recalled``: how the body was rebuilt from the tenant's previous one (its match is
        taken over where it still holds)."""
        return plan_turn(body, root, reader, policy, memo, guard, raw, recalled.known if recalled is not None else None)

    def outgoing(self, raw: bytes, body: Mapping[str, Any], plan: TurnPlan, traits: UpstreamTraits) -> Outgoing:
        """The client's bytes, with the repair spliced in, kvwarm's cache markers
        (:mod:`proxy.wire.cache_marks`) and, for a stream that did not ask for usage,
        ``stream_options.include_usage`` added; every other byte as the client sent it."""
        base = plan.spliced if plan.spliced is not None else raw
        marks: Marks | None = None
        if plan.tree is not None:  # the store was asked: this upstream may take markers
            base, marks = with_breakpoints(base, body, plan, traits, lambda dialect: ChatElements(plan.forwarded, dialect))
        options = body.get("stream_options")
        if (
            body.get("stream") is not True
            or traits.reports_timings
            or (isinstance(options, dict) and options.get("include_usage") is True)
        ):
            return Outgoing(body=base, usage_injected=False, marks=marks)
        edit: Edit
        if options is None and "stream_options" not in body:
            first = insert_first_member(base, _USAGE_MEMBER)
            if first is not None:
                return Outgoing(body=first, usage_injected=True, marks=marks)
        if options is None:
            edit = Insert(path=(), key="stream_options", value=_INCLUDE_USAGE)
        elif isinstance(options, dict):
            edit = (
                SetValue(path=("stream_options", "include_usage"), value=b"true")
                if "include_usage" in options
                else Insert(path=("stream_options",), key="include_usage", value=b"true")
            )
        else:
            return Outgoing(body=base, usage_injected=False, marks=marks)
        injected = splice(base, (edit,))
        # Refused (a duplicate "stream" or "stream_options" key): forward as sent, usage unknown.
        if injected is None:
            return Outgoing(body=base, usage_injected=False, marks=marks)
        return Outgoing(body=injected, usage_injected=True, marks=marks)

    def observer(self, outgoing: Outgoing, traits: UpstreamTraits, guard: Guard, *, success: bool) -> ChatObserver:
        return ChatObserver(outgoing.usage_injected, traits, guard, success=success)


class ChatObserver:
    """One chat response on its way to the client."""

    __slots__ = ("_assembler", "_body", "_guard", "_injected", "_success", "_traits", "usage")

    def __init__(self, usage_injected: bool, traits: UpstreamTraits, guard: Guard, *, success: bool) -> None:
        self._injected = usage_injected
        self._traits = traits
        self._guard = guard
        self._success = success
        """A 2xx response: only those carry a reply and usage worth reading."""
        self._assembler: ReplyAssembler | None = None
        """The reply of a stream, assembled from its chunks (made at the first event)."""
        self._body = BodyBuffer()
        self.usage: Usage | None = None

    # -- streams -----------------------------------------------------------------------

    def on_event(self, event: SSEEvent) -> Verdict:
        data = event.payload
        if data is None:
            return KEEP
        assembler = self._assembler
        if assembler is None:
            assembler = self._assembler = ReplyAssembler()
        if data == _DONE:
            assembler.done()
            return KEEP
        try:
            chunk = load_data(data)
        except orjson.JSONDecodeError:
            return KEEP
        if type(chunk) is not dict:
            return KEEP
        try:  # not ``with guard``: every event comes here (proxy/core/guard.py)
            self._read(chunk)
            assembler.feed(chunk)
        except Exception as exc:
            self._guard.fail("usage", exc)
            return KEEP
        if not self._injected:
            return KEEP
        if is_usage_only_chunk(chunk):
            return HIDE
        if "usage" in chunk and chunk["usage"] is None:
            stripped = without_null_usage(event.raw, chunk)
            return Replace(raw=stripped) if stripped is not None else KEEP
        return KEEP

    def is_terminal(self, event: SSEEvent) -> bool:
        return event.payload == _DONE

    # -- plain bodies --------------------------------------------------------------------

    def on_body(self, chunk: bytes) -> None:
        if self._success:
            self._body.add(chunk)

    def end(self, *, client_gone: bool) -> Reply | None:
        reply: Reply | None = None
        data = self._body.take()
        if data is not None:
            try:
                payload = body_json(data)
                if type(payload) is dict:
                    self._read(payload)
                    reply = reply_from_body(payload)
            except Exception as exc:
                self._guard.fail("usage", exc)
            return reply
        try:
            reply = self._assembler.result() if self._assembler is not None else None
        except Exception as exc:
            self._guard.fail("record", exc)
        if reply is not None and client_gone and not reply.partial:
            reply = Reply(
                message=reply.message, finish_reason=reply.finish_reason, partial=True, model=reply.model
            )
        return reply

    def _read(self, obj: Mapping[str, Any]) -> None:
        self.usage = merge_usage(self.usage, extract_usage(obj))
        if "timings" in obj:
            self._traits.reports_timings = True


_INCLUDE_USAGE = b'{"include_usage":true}'
_USAGE_MEMBER = b'"stream_options":' + _INCLUDE_USAGE


def insert_first_member(raw: bytes, member: bytes) -> bytes | None:
    """``raw`` (a parsed chat body without ``stream_options``) with ``member`` as its first member,
    where that is certain without reading the body through: the bytes :func:`~proxy.core.splice.splice`
    gives for the same insert, in O(1) Python steps instead of a scan of every member.

    A new top-level member changes no other member's meaning, whatever the body holds; what
    decides whether the option may be added is its one ``stream`` member, so the body must name
    ``"stream"`` once, ``"stream_options"`` nowhere, and hold no ``\\u`` escape (which could
    spell either). Else None: the caller splices.
    """
    if raw.count(b'"stream"') != 1 or b'"stream_options"' in raw or b"\\u" in raw:
        return None
    start = skip_space(raw, 0)
    if start >= len(raw) or raw[start] != 0x7B:  # "{"
        return None
    first = skip_space(raw, start + 1)
    if first >= len(raw) or raw[first] == 0x7D:  # "}": an empty object (no messages): the splice knows
        return None
    view = memoryview(raw)
    return b"".join((view[: start + 1], member, b",", view[start + 1 :]))


_NULL_USAGE = re.compile(rb',[ \t]*"usage"[ \t]*:[ \t]*null(?=[ \t]*[,}])|"usage"[ \t]*:[ \t]*null[ \t]*,[ \t]*')
_NULL_USAGE_TAIL = b',"usage":null}'


def without_null_usage(raw: bytes, chunk: Mapping[str, Any]) -> bytes | None:
    """``raw`` minus its top-level ``"usage": null`` member, the rest byte for byte; None if unsure."""
    line = raw.rstrip(b"\r\n")
    if line.endswith(_NULL_USAGE_TAIL) and line.startswith(b"data:") and b"\n" not in line and b"\r" not in line:
        # The common shape (OpenAI, vLLM): the member closes a one-line object. Just before the
        # object's final brace it can only be a top-level member: a nested object would end in "}}".
        return line[: -len(_NULL_USAGE_TAIL)] + b"}" + raw[len(line) :]
    stripped, n = _NULL_USAGE.subn(b"", raw, count=1)
    if n != 1:
        return None
    data = b"\n".join(line[5:].lstrip(b" ") for line in stripped.splitlines() if line.startswith(b"data:"))
    try:
        ok = orjson.loads(data) == {k: v for k, v in chunk.items() if k != "usage"}
    except orjson.JSONDecodeError:
        ok = False
    return stripped if ok else None
