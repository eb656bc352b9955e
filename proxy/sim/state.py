"""The reference upstream's configuration and memory: :class:`SimConfig`, :class:`SimState`.

One :class:`SimState` per app (under :data:`SIM_STATE`) holds everything the
emulated provider remembers: one prefix cache shared by every endpoint (one
engine serves chat and Responses alike), the request log, and the stored
Responses (``store: true``) that ``previous_response_id`` refers to.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from .cache import PrefixCache
from .response_store import ResponseStore

CACHE_MODES = ("openai", "vllm")
BLOCK_SIZES = {"openai": 128, "vllm": 16}
"""Tokens per prefix-cache block in each cache mode."""
MIN_CACHED_TOKENS = {"openai": 1024, "vllm": 0}
"""Shortest prompt the cache serves in each mode (OpenAI: no hit below 1024 tokens)."""
REQUEST_LOG_SIZE = 1000
MODEL_ID = "kvwarm-sim"
"""The one model listed; also the ``model`` of replies to requests that name none."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """How the reference upstream behaves."""

    cache_mode: str = "openai"
    """``"openai"`` (128-token blocks, hits from 1024 tokens, prompts only) or
    ``"vllm"`` (16-token blocks, the generated reply is cached too)."""
    openhuman: bool = False
    """Add ``openhuman.usage`` / ``openhuman.billing`` blocks."""
    ttl_seconds: float = 3600.0
    """Prefix-cache TTL since last use."""
    capacity_blocks: int = 200_000
    """LRU bound of the prefix cache, in blocks (used when ``kv_capacity_tokens`` is unset)."""
    kv_capacity_tokens: int | None = None
    """LRU bound of the prefix cache in tokens: it holds at most this many tokens' worth of
    blocks (``kv_capacity_tokens // block size``), as an engine's KV memory does. ``None``:
    ``capacity_blocks`` (practically unbounded)."""
    stored_responses: int = 1000
    """How many ``store: true`` Responses are kept for ``previous_response_id`` (oldest go first)."""
    ttft_base: float = 0.0
    """Seconds before the first token."""
    ttft_per_uncached_token: float = 0.0
    """Extra seconds per uncached prompt token."""
    chunk_delay: float = 0.0
    """Seconds between streamed chunks."""
    price_input: float = 2.5
    """USD per 1M uncached input tokens (openhuman billing)."""
    price_cached_input: float = 1.25
    """USD per 1M cached input tokens."""
    price_output: float = 10.0
    """USD per 1M output tokens."""

    def __post_init__(self) -> None:
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {CACHE_MODES}, not {self.cache_mode!r}")
        for name in ("ttft_base", "ttft_per_uncached_token", "chunk_delay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        block_size = BLOCK_SIZES[self.cache_mode]
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < block_size:
            raise ValueError(
                f"kv_capacity_tokens must be at least one block ({block_size} tokens "
                f"in {self.cache_mode} mode), not {self.kv_capacity_tokens}"
            )
        if self.stored_responses < 0:
            raise ValueError("stored_responses must be >= 0")

    @property
    def block_size(self) -> int:
        """Tokens per prefix-cache block in this cache mode."""
        return BLOCK_SIZES[self.cache_mode]

    @property
    def cache_blocks(self) -> int:
        """The prefix cache's capacity in blocks."""
        if self.kv_capacity_tokens is None:
            return self.capacity_blocks
        return self.kv_capacity_tokens // self.block_size


def cache_for(config: SimConfig) -> PrefixCache:
    """The prefix cache of ``config.cache_mode``, bounded as configured."""
    return PrefixCache(
        config.block_size,
        MIN_CACHED_TOKENS[config.cache_mode],
        config.ttl_seconds,
        config.cache_blocks,
    )


@dataclass(frozen=True, slots=True)
class ReceivedRequest:
    """One request to a model endpoint, as the reference upstream received it."""

    method: str
    path: str
    headers: dict[str, str]
    """Header names lower-cased."""
    body: bytes
    endpoint: str = "chat.completions"
    """Which API: ``"chat.completions"`` or ``"responses"``."""


@dataclass(slots=True)
class SimState:
    """Everything the reference upstream remembers; lives in the app under :data:`SIM_STATE`."""

    config: SimConfig
    cache: PrefixCache
    responses: ResponseStore = field(default_factory=ResponseStore)
    """Stored Responses (``store: true``), for ``previous_response_id`` and ``GET``."""
    requests: list[ReceivedRequest] = field(default_factory=list)
    """The last :data:`REQUEST_LOG_SIZE` model requests, most recent last."""
    clock: Callable[[], float] = time.monotonic
    """Time source of the prefix cache (replaceable in tests)."""

    @classmethod
    def create(cls, config: SimConfig) -> SimState:
        """A fresh state for ``config``."""
        return cls(
            config=config,
            cache=cache_for(config),
            responses=ResponseStore(config.stored_responses),
        )

    def record(self, request: ReceivedRequest) -> None:
        self.requests.append(request)
        if len(self.requests) > REQUEST_LOG_SIZE:
            del self.requests[: len(self.requests) - REQUEST_LOG_SIZE]

    def reset(self) -> None:
        """Forget everything: cached blocks, stored Responses, the request log."""
        self.cache.clear()
        self.responses.clear()
        self.requests.clear()


SIM_STATE: web.AppKey[SimState] = web.AppKey("sim_state", SimState)
