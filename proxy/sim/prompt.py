"""A rendered prompt as the emulated engine sees it, and the request parsing the endpoints share.

:class:`Prompt` holds the template's segments, their tokens, the tokens' chained
block hashes (the prefix cache's keys) and a seed (the hash of the prompt text)
that makes the reply deterministic. Building one is CPU work:
:func:`off_loop` runs it in a worker thread for big bodies.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from . import markers
from .breakpoint_cache import token_bytes
from .cache import block_hashes
from .layout import layout
from .markers import CachePlan
from .render import Segment, encode_with_starts, render_segments, segments_text
from .state import MODEL_ID, SimConfig

CHAT = "chat"
RESPONSES = "responses"
MESSAGES = "messages"
"""The APIs a prompt comes from: each places its cache markers in its own fields."""
_MARKER_CHECKS = {
    CHAT: markers.check_chat,
    RESPONSES: markers.check_responses,
    MESSAGES: markers.check_messages,
}

THREAD_THRESHOLD_BYTES = 20_000
"""Bodies larger than this are parsed, rendered, tokenized and block-hashed in a worker thread."""

T = TypeVar("T")


class InvalidJSON(ValueError):
    """The request body is not JSON."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Prompt:
    """A parsed request and its rendered prompt."""

    request: dict[str, Any]
    segments: list[Segment]
    tokens: list[int]
    hashes: list[bytes]
    """Chained block hashes of ``tokens`` (for the block cache; empty in the breakpoint modes)."""
    seed: bytes
    """Hash of the prompt text: what makes the reply deterministic."""
    starts: list[int]
    """Where each segment starts in ``tokens``."""
    plan: CachePlan | None = None
    """What the request asks of the breakpoint cache (breakpoint modes)."""


def load_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object: :class:`InvalidJSON` when not JSON, ``ValueError`` when not an object."""
    try:
        # The stdlib parser keeps integers beyond 64 bits exact (orjson turns them
        # into floats, which would render differently from what the client sent).
        request = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise InvalidJSON(f"the body is not valid JSON: {exc}") from None
    if not isinstance(request, dict):
        raise ValueError("the body must be a JSON object")
    return request


def make_prompt(
    request: dict[str, Any], segments: list[Segment], block_size: int | None
) -> Prompt:
    """Tokenize and block-hash ``segments``, the rendering of ``request`` (``block_size``
    ``None``: no block hashes, for the breakpoint modes)."""
    tokens, starts = encode_with_starts(segments)
    return Prompt(
        request=request,
        segments=segments,
        tokens=tokens,
        hashes=block_hashes(tokens, block_size) if block_size is not None else [],
        seed=hashlib.sha256(segments_text(segments).encode()).digest(),
        starts=starts,
    )


def build_prompt(
    config: SimConfig,
    request: dict[str, Any],
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None,
    *,
    api: str = CHAT,
) -> Prompt:
    """The prompt of ``request`` (from ``api``: :data:`CHAT`, :data:`RESPONSES` or
    :data:`MESSAGES`), whose template input is ``messages`` and ``tools``; in the
    breakpoint modes, with its cache plan. ``ValueError`` (:class:`.markers.MarkerError`,
    naming the field) for a request the template or the mode refuses."""
    responses = api == RESPONSES
    if config.breakpoints:
        _MARKER_CHECKS[api](config.cache_mode, request)
    segments = render_segments(messages, tools)
    prompt = make_prompt(request, segments, None if config.breakpoints else config.block_size)
    if not config.breakpoints:
        return prompt
    model = request.get("model")
    plan = markers.plan(
        config.cache_mode,
        request,
        layout(messages, tools, prompt.segments, prompt.tokens, prompt.starts),
        token_bytes(prompt.tokens),
        model=model if isinstance(model, str) and model else MODEL_ID,
        implicit_ttl=config.implicit_ttl_seconds,
        responses=responses,
    )
    return replace(prompt, plan=plan)


async def off_loop(size: int, function: Callable[..., T], *args: Any) -> T:
    """``function(*args)``, in a worker thread when the body (``size`` bytes) is big."""
    if size > THREAD_THRESHOLD_BYTES:
        return await asyncio.to_thread(function, *args)
    return function(*args)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
