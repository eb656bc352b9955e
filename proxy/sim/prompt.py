"""A rendered prompt as the emulated engine sees it, and the request parsing both endpoints share.

:class:`Prompt` holds the template's segments, their tokens, the tokens' chained
block hashes (the prefix cache's keys) and a seed (the hash of the prompt text)
that makes the reply deterministic. Building one is CPU work:
:func:`off_loop` runs it in a worker thread for big bodies.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .cache import block_hashes
from .render import Segment, encode_segments, segments_text

THREAD_THRESHOLD_BYTES = 20_000
"""Bodies larger than this are parsed, rendered, tokenized and block-hashed in a worker thread."""

T = TypeVar("T")


class InvalidJSON(ValueError):
    """The request body is not JSON."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """A parsed request and its rendered prompt."""

    request: dict[str, Any]
    segments: list[Segment]
    tokens: list[int]
    hashes: list[bytes]
    """Chained block hashes of ``tokens`` (for the prefix cache)."""
    seed: bytes
    """Hash of the prompt text: what makes the reply deterministic."""


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


def make_prompt(request: dict[str, Any], segments: list[Segment], block_size: int) -> Prompt:
    """Tokenize and block-hash ``segments``, the rendering of ``request``."""
    tokens = encode_segments(segments)
    return Prompt(
        request=request,
        segments=segments,
        tokens=tokens,
        hashes=block_hashes(tokens, block_size),
        seed=hashlib.sha256(segments_text(segments).encode()).digest(),
    )


async def off_loop(size: int, function: Callable[..., T], *args: Any) -> T:
    """``function(*args)``, in a worker thread when the body (``size`` bytes) is big."""
    if size > THREAD_THRESHOLD_BYTES:
        return await asyncio.to_thread(function, *args)
    return function(*args)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
