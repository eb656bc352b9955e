"""Cache markers, and the plan they make: which prefixes a request writes, where it may read.

The two breakpoint modes of the reference upstream (``SimConfig.cache_mode``)
each read one dialect of markers; the other dialect's markers, like every marker
in the ``openai`` and ``vllm`` modes, are ignored. Markers never render
(:mod:`.render`): a marked prompt has the unmarked prompt's tokens. Blocks and
where they end are :mod:`.layout`'s; the cache that holds the prefixes is
:mod:`.breakpoint_cache`.

**openai-breakpoints** (GPT-5.6 and later; Chat Completions and Responses):

- ``"prompt_cache_breakpoint": {"mode": "explicit", "ttl"?: "30m" | "12h"}`` on
  a content part of a system, developer, user or tool message (Responses: an
  ``input_text`` / ``input_image`` / ``input_file`` part, or a non-assistant
  item such as ``function_call_output``); on a whole message or item it marks
  the message's last block (:mod:`.layout`). On assistant content or on a tool
  it is refused (400): assistant output is not a block a breakpoint may end.
- ``"prompt_cache_options": {"mode": "implicit" | "explicit", "ttl": "30m"}``
  (Responses also ``"12h"`` and ``comparison_response_id``, :mod:`.diagnostics`);
  with ``prompt_cache_retention`` beside it: 400.
- In ``implicit`` mode (the default) one implicit breakpoint sits at the end of
  the latest user or tool message (Responses: user message or tool output),
  and the latest three explicit breakpoints are written with it; in
  ``explicit`` mode the latest four explicit ones, and without any the request
  neither reads nor writes. Further explicit breakpoints are accepted and not
  written, as documented by OpenAI ("writes up to the latest four").
- A written prefix is at least 1024 tokens. TTL: the breakpoint's own, else the
  request's (30 minutes by default); the implicit breakpoint's is the request's
  unless ``SimConfig.implicit_ttl_seconds`` says otherwise.
- A prompt reads the longest prefix written under its key (model,
  ``prompt_cache_key``, first 256 tokens) among that key's 80 most recently used,
  whatever block it ends at: no lookback limit.

**anthropic** (``cache_control`` as Anthropic's Messages API takes it, and as
OpenRouter and DashScope accept it on chat; the Responses API is read the same
way, except on assistant items, which merge into one assistant message and keep
no markers):

- ``"cache_control": {"type": "ephemeral", "ttl"?: "5m" | "1h"}`` on a content
  part or block (any role; Messages: a ``system`` block, a ``text`` / ``image``
  / ``document`` / ``tool_use`` / ``tool_result`` block or a block inside a
  ``tool_result``, :mod:`.content_blocks`), a tool call, a message (its last
  block) or a tool (the tool object's top level); at the top level of the
  request it marks the last block of the prompt (automatic caching) and counts
  as one of the four, unless that block is marked already.
- More than four marked blocks: 400, with Anthropic's message.
- Each breakpoint writes its prefix (at least 1024 tokens) for 5 minutes, or an
  hour with ``"1h"``. A prompt reads the longest written prefix ending at a
  breakpoint or at one of the 20 blocks before it, under its key (the model).
  Without markers nothing is read or written.

Pure: no I/O; refusals are :class:`MarkerError` naming the offending field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .diagnostics import cache_settings
from .items import TOOL_OUTPUT_TYPES, InputError, input_items, item_type
from .layout import Layout

OPENAI_BREAKPOINTS = "openai-breakpoints"
ANTHROPIC = "anthropic"
BREAKPOINT_MODES = (OPENAI_BREAKPOINTS, ANTHROPIC)

MIN_PREFIX_TOKENS = 1024
"""Shortest prefix either dialect writes."""
OPENAI_TTLS = {"30m": 30 * 60.0, "12h": 12 * 3600.0}
OPENAI_LONG_TTL = "12h"
CHAT_OPTION_TTLS = ("30m",)
"""``prompt_cache_options.ttl`` on Chat Completions (breakpoints and Responses also take ``12h``)."""
OPENAI_WRITES = 4
"""Breakpoints one request writes, the implicit one included."""
OPENAI_WINDOW = 80
"""Written breakpoints of one key that a prompt may read."""
ROUTING_TOKENS = 256
"""Leading tokens that, with ``prompt_cache_key``, route a request (OpenAI)."""
ANTHROPIC_TTLS = {"5m": 5 * 60.0, "1h": 3600.0}
ANTHROPIC_LONG_TTL = "1h"
ANTHROPIC_MAX_BLOCKS = 4
ANTHROPIC_LOOKBACK = 20
"""Blocks before a breakpoint at whose end a written prefix is still found."""

_READERS = ("user", "tool")
"""Roles the implicit breakpoint follows (a user message, a tool's output)."""
_TOKEN_BYTES = 8


class MarkerError(InputError):
    """A marker or a cache option the provider refuses."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Write:
    """One prefix a request writes."""

    offset: int
    """Its length in tokens."""
    ttl: float
    """Seconds it lives after its last use."""
    long: bool
    """Written with the long TTL (``12h``, ``1h``): billed and reported apart."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CachePlan:
    """What one request asks of the breakpoint cache."""

    key: bytes
    """The cache key its prefixes are written and read under."""
    writes: tuple[Write, ...]
    """The prefixes it writes, shortest first, each at least :data:`MIN_PREFIX_TOKENS`."""
    reads: tuple[int, ...] | None
    """The prefix lengths it may read; ``None``: any in its key's window."""
    data: bytes
    """Its tokens, for prefix digests (:func:`.breakpoint_cache.token_bytes`)."""
    length: int
    """Its prompt tokens."""
    boundaries: tuple[int, ...] = ()
    """Where each of its messages ends (the diagnostics compare prompts there)."""
    options: Mapping[str, Any] | None = None
    """The ``prompt_cache_options`` applied (openai-breakpoints), as a response echoes them."""
    comparison_id: str | None = None
    """``prompt_cache_options.comparison_response_id``: diagnostics were asked for."""
    settings: tuple[tuple[str, str], ...] | None = None
    """What else the cache depends on (:func:`.diagnostics.cache_settings`); ``None``: no
    diagnostics fingerprint is kept (chat)."""


def check_chat(mode: str, request: Mapping[str, Any]) -> None:
    """Refuse (:class:`MarkerError`) the markers and options of a chat request ``mode`` refuses."""
    _check(mode, request, _chat_places(request), CHAT_OPTION_TTLS)


def check_responses(mode: str, request: Mapping[str, Any]) -> None:
    """Refuse the markers and options of a Responses request (its own ``input``, not the
    items ``previous_response_id`` brings, which were checked when they were sent)."""
    _check(mode, request, _response_places(request), tuple(OPENAI_TTLS))


def check_messages(mode: str, request: Mapping[str, Any]) -> None:
    """Refuse the markers and options of a Messages request (Anthropic's API) ``mode`` refuses."""
    _check(mode, request, _message_places(request), tuple(OPENAI_TTLS))


def plan(
    mode: str,
    request: Mapping[str, Any],
    layout: Layout,
    data: bytes,
    *,
    model: str,
    implicit_ttl: float | None = None,
    responses: bool = False,
) -> CachePlan:
    """The plan of a request whose markers were checked and whose prompt is laid out as
    ``layout``. ``data``: its tokens' bytes. Raises :class:`MarkerError` for too many
    ``cache_control`` blocks."""
    length = len(data) // _TOKEN_BYTES
    if mode == ANTHROPIC:
        writes, looked = _anthropic(request, layout)
        key = _digest(model.encode())
        return CachePlan(key=key, writes=_writable(writes, length), reads=looked, data=data, length=length)
    options = _options(request)
    writes, reads = _openai(options, layout, implicit_ttl)
    pck = request.get("prompt_cache_key")
    routing = data[: ROUTING_TOKENS * _TOKEN_BYTES]
    key = _digest(model.encode(), (pck if isinstance(pck, str) else "").encode(), routing)
    comparison = options.get("comparison_response_id") if responses else None
    return CachePlan(
        key=key,
        writes=_writable(writes, length),
        reads=reads,
        data=data,
        length=length,
        boundaries=tuple(layout.message_ends()) if responses else (),
        options=_echo(options, comparison) if responses else None,
        comparison_id=comparison if isinstance(comparison, str) else None,
        settings=cache_settings(request, model, layout.tools_text()) if responses else None,
    )


def _openai(
    options: Mapping[str, Any], layout: Layout, implicit_ttl: float | None
) -> tuple[list[Write], tuple[int, ...] | None]:
    request_ttl = options.get("ttl", "30m")
    explicit: list[Write] = []
    for index, block in enumerate(layout.blocks):
        marker = _marker(block.sources, "prompt_cache_breakpoint")
        if marker is None or block.role in ("assistant", "tools"):
            continue
        ttl = marker.get("ttl", request_ttl)
        explicit.append(Write(offset=layout.offset(index), ttl=OPENAI_TTLS[ttl], long=ttl == OPENAI_LONG_TTL))
    explicit = _distinct(explicit)
    if options.get("mode") == "explicit":
        return explicit[-OPENAI_WRITES:], None if explicit else ()
    writes = explicit[-(OPENAI_WRITES - 1) :]
    for index in range(len(layout.blocks) - 1, -1, -1):
        block = layout.blocks[index]
        if block.closes and block.role in _READERS:
            ttl = OPENAI_TTLS[request_ttl] if implicit_ttl is None else implicit_ttl
            long = implicit_ttl is None and request_ttl == OPENAI_LONG_TTL
            writes.append(Write(offset=layout.offset(index), ttl=ttl, long=long))
            break
    return writes, None


def _anthropic(request: Mapping[str, Any], layout: Layout) -> tuple[list[Write], tuple[int, ...]]:
    marked: dict[int, Mapping[str, Any]] = {}
    for index, block in enumerate(layout.blocks):
        marker = _marker(block.sources, "cache_control")
        if marker is not None:
            marked[index] = marker
    automatic = request.get("cache_control")
    if isinstance(automatic, Mapping) and layout.blocks:
        marked.setdefault(len(layout.blocks) - 1, automatic)
    if len(marked) > ANTHROPIC_MAX_BLOCKS:
        raise MarkerError(
            f"A maximum of {ANTHROPIC_MAX_BLOCKS} blocks with cache_control may be provided. "
            f"Found {len(marked)}."
        )
    writes = []
    for index, marker in marked.items():
        ttl = marker.get("ttl", "5m")
        writes.append(Write(offset=layout.offset(index), ttl=ANTHROPIC_TTLS[ttl], long=ttl == ANTHROPIC_LONG_TTL))
    looked = {j for i in marked for j in range(max(0, i - ANTHROPIC_LOOKBACK), i + 1)}
    reads = {layout.offset(j) for j in looked}
    return writes, tuple(sorted(n for n in reads if n >= MIN_PREFIX_TOKENS))


def _writable(writes: Sequence[Write], length: int) -> tuple[Write, ...]:
    """The writes long enough and inside the prompt, :func:`_distinct`."""
    return tuple(_distinct([w for w in writes if MIN_PREFIX_TOKENS <= w.offset < length]))


def _distinct(writes: Sequence[Write]) -> list[Write]:
    """One write per offset (the longest-lived), shortest first: two markers ending at the
    same token are one breakpoint."""
    kept: dict[int, Write] = {}
    for write in writes:
        other = kept.get(write.offset)
        if other is None or write.ttl > other.ttl:
            kept[write.offset] = write
    return [kept[offset] for offset in sorted(kept)]


def _marker(sources: Sequence[Any], name: str) -> Mapping[str, Any] | None:
    for source in sources:
        if isinstance(source, Mapping):
            marker = source.get(name)
            if isinstance(marker, Mapping):
                return marker
    return None


def _options(request: Mapping[str, Any]) -> Mapping[str, Any]:
    options = request.get("prompt_cache_options")
    return options if isinstance(options, Mapping) else {}


def _echo(options: Mapping[str, Any], comparison: Any) -> dict[str, Any]:
    return {
        "mode": options.get("mode", "implicit"),
        "ttl": options.get("ttl", "30m"),
        "comparison_response_id": comparison if isinstance(comparison, str) else None,
    }


def _digest(*parts: bytes) -> bytes:
    hasher = hashlib.blake2b(digest_size=16, person=b"kvwarm-sim-key")
    for part in parts:
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
    return hasher.digest()


# -- refusals -----------------------------------------------------------------------------------

Place = tuple[str, str, Mapping[str, Any]]
"""Where a marker may sit: its param path, the role it belongs to, the object."""


def _check(
    mode: str, request: Mapping[str, Any], places: Iterator[Place], option_ttls: Sequence[str]
) -> None:
    if mode == ANTHROPIC:
        _check_cache_control(request.get("cache_control"), "cache_control")
        for path, _, obj in places:
            _check_cache_control(obj.get("cache_control"), f"{path}.cache_control")
    elif mode == OPENAI_BREAKPOINTS:
        _check_options(request, option_ttls)
        for path, role, obj in places:
            _check_breakpoint(obj.get("prompt_cache_breakpoint"), path, role)


def _check_options(request: Mapping[str, Any], ttls: Sequence[str]) -> None:
    options = request.get("prompt_cache_options")
    if options is None:
        return
    if not isinstance(options, Mapping):
        raise MarkerError("'prompt_cache_options' must be an object.", "prompt_cache_options")
    if request.get("prompt_cache_retention") is not None:
        raise MarkerError(
            "prompt_cache_options cannot be combined with the deprecated prompt_cache_retention; "
            "use prompt_cache_options.ttl.",
            "prompt_cache_retention",
        )
    _check_value(options.get("mode", "implicit"), ("implicit", "explicit"), "prompt_cache_options.mode")
    _check_value(options.get("ttl", "30m"), ttls, "prompt_cache_options.ttl")
    comparison = options.get("comparison_response_id")
    if comparison is not None and not isinstance(comparison, str):
        raise MarkerError(
            "'prompt_cache_options.comparison_response_id' must be a string.",
            "prompt_cache_options.comparison_response_id",
        )


def _check_breakpoint(marker: Any, path: str, role: str) -> None:
    if marker is None:
        return
    param = f"{path}.prompt_cache_breakpoint"
    if not isinstance(marker, Mapping):
        raise MarkerError(f"'{param}' must be an object.", param)
    _check_value(marker.get("mode"), ("explicit",), f"{param}.mode")
    _check_value(marker.get("ttl", "30m"), tuple(OPENAI_TTLS), f"{param}.ttl")
    if role == "assistant":
        raise MarkerError(
            "prompt_cache_breakpoint is not supported on assistant content: place it on a "
            "system, developer, user or tool content block.",
            param,
        )
    if role == "tools":
        raise MarkerError("prompt_cache_breakpoint is not supported on tools.", param)


def _check_cache_control(marker: Any, param: str) -> None:
    if marker is None:
        return
    if not isinstance(marker, Mapping):
        raise MarkerError(f"{param}: Input should be an object", param)
    if marker.get("type") != "ephemeral":
        raise MarkerError(f"{param}.type: Input should be 'ephemeral'", f"{param}.type")
    ttl = marker.get("ttl", "5m")
    if ttl not in ANTHROPIC_TTLS:
        raise MarkerError(f"{param}.ttl: Input should be '5m' or '1h'", f"{param}.ttl")


def _check_value(value: Any, allowed: Sequence[str], param: str) -> None:
    if value not in allowed:
        supported = ", ".join(f"'{name}'" for name in allowed)
        raise MarkerError(
            f"Invalid value: {value!r}. Supported values are: {supported}.", param
        )


def _chat_places(request: Mapping[str, Any]) -> Iterator[Place]:
    messages = request.get("messages")
    for index, message in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        role = role if isinstance(role, str) else ""
        path = f"messages[{index}]"
        yield path, role, message
        yield from _parts(message.get("content"), f"{path}.content", role)
        yield from _parts(message.get("tool_calls"), f"{path}.tool_calls", "assistant")
    yield from _parts(request.get("tools"), "tools", "tools")


def _response_places(request: Mapping[str, Any]) -> Iterator[Place]:
    instructions = request.get("instructions")
    if isinstance(instructions, list):
        yield from _items(instructions, "instructions")
    try:
        items = input_items(request.get("input"))
    except InputError:
        items = []  # refused with its own message when the input is read
    yield from _items(items, "input")
    yield from _parts(request.get("tools"), "tools", "tools")


def _message_places(request: Mapping[str, Any]) -> Iterator[Place]:
    """Where a Messages request may carry markers, in Anthropic's paths (``messages.0.content.1``):
    system blocks, tools, messages, their content blocks and a ``tool_result``'s own blocks."""
    yield from _blocks(request.get("system"), "system", "system")
    yield from _blocks(request.get("tools"), "tools", "tools")
    messages = request.get("messages")
    for index, message in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        role = role if isinstance(role, str) else ""
        path = f"messages.{index}"
        yield path, role, message
        for place in _blocks(message.get("content"), f"{path}.content", role):
            yield place
            if place[2].get("type") == "tool_result":
                yield from _blocks(place[2].get("content"), f"{place[0]}.content", "tool")


def _blocks(blocks: Any, path: str, role: str) -> Iterator[Place]:
    if isinstance(blocks, list):
        for index, block in enumerate(blocks):
            if isinstance(block, Mapping):
                yield f"{path}.{index}", role, block


def _items(items: Sequence[Any], name: str) -> Iterator[Place]:
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            continue
        kind = item_type(item)
        path = f"{name}[{index}]"
        if kind == "message":
            role = item.get("role")
            role = role if isinstance(role, str) else ""
            yield path, role, item
            yield from _parts(item.get("content"), f"{path}.content", role)
        elif kind in TOOL_OUTPUT_TYPES:
            yield path, "tool", item
            yield from _parts(item.get("output"), f"{path}.output", "tool")
        else:
            # Calls and reasoning are the model's own output.
            role = "assistant" if kind.endswith("_call") or kind == "reasoning" else kind
            yield path, role, item


def _parts(parts: Any, path: str, role: str) -> Iterator[Place]:
    if isinstance(parts, list):
        for index, part in enumerate(parts):
            if isinstance(part, Mapping):
                yield f"{path}[{index}]", role, part
