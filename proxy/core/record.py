"""The assistant reply exactly as the model generated it, from a JSON body or from SSE deltas.

The reply becomes the canonical form of the next turn's assistant message: when
the agent re-sends it re-serialized, kvwarm restores these strings byte for
byte. So assembly is exact: content and reasoning deltas are concatenated as
they came, tool calls are gathered by their ``index`` with argument fragments
concatenated verbatim (never parsed and re-dumped), and transport-only keys
(the delta ``index``) are dropped.

Only the first choice (``index`` 0) is assembled; with ``n > 1`` the others
are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from mypy_extensions import mypyc_attr

from .usage import is_mapping

__all__ = ["Reply", "ReplyAssembler", "reply_from_body"]

_REASONING_KEYS = ("reasoning_content", "reasoning")


@dataclass(init=False, unsafe_hash=True)  # built per request (proxy/core/values.py)
class Reply:
    """One generated assistant message."""

    message: Final[dict[str, Any]]
    """``{"role": "assistant", "content": str | None}`` plus, when generated, ``tool_calls``
    (``[{"id", "type", "function": {"name", "arguments"}}]`` in index order) and
    ``reasoning_content`` / ``reasoning``: the exact generated strings."""
    finish_reason: Final[str | None]
    partial: Final[bool]
    """The stream ended without a ``finish_reason``: what the client got was cut short."""
    model: Final[str | None]
    following: Final[tuple[dict[str, Any], ...]]
    """Further generated elements after ``message``, in order (a Responses reply may hold several
    output items: a reasoning item, then function calls); each becomes its own node."""

    def __init__(
        self,
        *,
        message: dict[str, Any],
        finish_reason: str | None,
        partial: bool,
        model: str | None,
        following: tuple[dict[str, Any], ...] = (),
    ) -> None:
        self.message = message
        self.finish_reason = finish_reason
        self.partial = partial
        self.model = model
        self.following = following

    @property
    def messages(self) -> tuple[dict[str, Any], ...]:
        return (self.message, *self.following)


def reply_from_body(body: Mapping[str, Any]) -> Reply | None:
    """The reply of a non-streaming chat.completion (``choices[0].message``); None if absent."""
    if not is_mapping(body):
        return None
    choice = _first_choice(body.get("choices"))
    if choice is None:
        return None
    source = choice.get("message")
    if not is_mapping(source):
        return None
    message: dict[str, Any] = {"role": "assistant", "content": source.get("content")}
    for key in _REASONING_KEYS:
        value = source.get(key)
        if isinstance(value, str) and value:
            message[key] = value
    calls = source.get("tool_calls")
    if isinstance(calls, list):
        tool_calls = [_tool_call_from_body(call) for call in calls if is_mapping(call)]
        if tool_calls:
            message["tool_calls"] = tool_calls
    finish = choice.get("finish_reason")
    return Reply(
        message=message,
        finish_reason=finish if isinstance(finish, str) else None,
        partial=False,
        model=_str(body.get("model")),
    )


@mypyc_attr(allow_interpreted_subclasses=True)  # the tests subclass it (proxy/native.py)
class ReplyAssembler:
    """Builds the reply of a stream from its parsed chat.completion.chunk objects."""

    __slots__ = ("_calls", "_content", "_done", "_finish", "_model", "_reasoning")

    def __init__(self) -> None:
        self._content: list[str] | None = None
        self._reasoning: dict[str, list[str]] = {}
        self._calls: dict[int, _CallParts] = {}
        self._finish: str | None = None
        self._model: str | None = None
        self._done = False

    def feed(self, chunk: Mapping[str, Any]) -> None:
        """Take one parsed chunk; chunks without a choice 0 (e.g. usage-only) only set the model."""
        if type(chunk) is dict and self._model is not None:
            # A model's token: one choice whose delta holds only text (what :meth:`_feed` reads
            # from it, in a few dict reads; once per token of every stream).
            choices = chunk.get("choices")
            if type(choices) is list and len(choices) == 1:
                choice = choices[0]
                index = choice.get("index", 0) if type(choice) is dict else None
                if index == 0 and type(index) is int and choice.get("finish_reason") is None:
                    delta = choice.get("delta")
                    if type(delta) is dict and len(delta) == 1:
                        content = delta.get("content")
                        if type(content) is str:
                            if self._content is None:
                                self._content = []
                            self._content.append(content)
                            return
        self._feed(chunk)

    def _feed(self, chunk: Mapping[str, Any]) -> None:
        if not is_mapping(chunk):
            return
        if self._model is None:
            self._model = _str(chunk.get("model")) or None
        choice = _first_choice(chunk.get("choices"))
        if choice is None:
            return
        finish = choice.get("finish_reason")
        if isinstance(finish, str) and finish:
            self._finish = finish
        delta = choice.get("delta")
        if not is_mapping(delta):
            return
        content = delta.get("content")
        if isinstance(content, str):
            if self._content is None:
                self._content = []
            self._content.append(content)
        for key in _REASONING_KEYS:
            piece = delta.get(key)
            if isinstance(piece, str):
                self._reasoning.setdefault(key, []).append(piece)
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                if is_mapping(call):
                    self._feed_call(call)

    def done(self) -> None:
        """The stream sent ``data: [DONE]``.

        It does not by itself make the reply complete: servers such as vLLM send
        ``[DONE]`` right after an error chunk, so only a ``finish_reason`` does.
        """
        self._done = True

    @property
    def saw_done(self) -> bool:
        """Whether :meth:`done` was called."""
        return self._done

    def result(self) -> Reply | None:
        """The reply so far; ``None`` when nothing was generated and no finish was seen."""
        reasoning = {key: "".join(parts) for key, parts in self._reasoning.items()}
        reasoning = {key: text for key, text in reasoning.items() if text}
        if self._content is None and not self._calls and not reasoning and self._finish is None:
            return None
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if self._content is None else "".join(self._content),
        }
        for key in _REASONING_KEYS:
            if key in reasoning:
                message[key] = reasoning[key]
        if self._calls:
            message["tool_calls"] = [self._calls[i].build() for i in sorted(self._calls)]
        return Reply(
            message=message,
            finish_reason=self._finish,
            partial=self._finish is None,
            model=self._model,
        )

    def _feed_call(self, call: Mapping[str, Any]) -> None:
        index = call.get("index")
        call_id = _str(call.get("id"))
        if isinstance(index, bool) or not isinstance(index, int):
            # No index (some OpenAI-compatible servers): a new id starts a new call,
            # anything else continues the latest one.
            last = max(self._calls) if self._calls else None
            if last is None or (call_id and self._calls[last].id not in (None, call_id)):
                index = 0 if last is None else last + 1
            else:
                index = last
        parts = self._calls.get(index)
        if parts is None:
            parts = self._calls[index] = _CallParts()
        if call_id and parts.id is None:
            parts.id = call_id
        kind = _str(call.get("type"))
        if kind and parts.type is None:
            parts.type = kind
        function = call.get("function")
        if is_mapping(function):
            name = function.get("name")
            if isinstance(name, str) and name and name != parts.name:
                # Some servers repeat the whole name on every delta; others stream it once.
                parts.name = name if parts.name is None else parts.name + name
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                parts.arguments.append(arguments)


class _CallParts:
    __slots__ = ("arguments", "id", "name", "type")

    def __init__(self) -> None:
        self.id: str | None = None
        self.type: str | None = None
        self.name: str | None = None
        self.arguments: list[str] = []

    def build(self) -> dict[str, Any]:
        call: dict[str, Any] = {}
        if self.id is not None:
            call["id"] = self.id
        call["type"] = self.type or "function"
        call["function"] = {"name": self.name or "", "arguments": "".join(self.arguments)}
        return call


def _tool_call_from_body(call: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    out["type"] = _str(call.get("type")) or "function"
    function = call.get("function")
    function = function if is_mapping(function) else {}
    name = function.get("name")
    arguments = function.get("arguments", "")
    out["function"] = {
        "name": name if isinstance(name, str) else "",
        # A server that returns arguments as an object: keep the value as generated.
        "arguments": "" if arguments is None else arguments,
    }
    return out


def _first_choice(choices: Any) -> Mapping[str, Any] | None:
    """The choice with ``index`` 0 (the first choice when indexes are absent)."""
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if is_mapping(choice):
            index = choice.get("index", 0)
            if index == 0 and not isinstance(index, bool):
                return choice
    return None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None
