"""The reference upstream's configuration and memory: :class:`SimConfig`, :class:`SimState`.

One :class:`SimState` per app (under :data:`SIM_STATE`) holds everything the
emulated provider remembers: one prompt cache shared by every endpoint (one
engine serves chat, Responses and Messages alike) -- the block cache in the ``openai``
and ``vllm`` modes, the breakpoint cache in the breakpoint modes -- the
request log, the stored Responses (``store: true``) that
``previous_response_id`` refers to, and the clock every TTL runs on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from .breakpoint_cache import BreakpointCache
from .cache import PrefixCache
from .clock import SimClock
from .diagnostics import Fingerprints
from .markers import ANTHROPIC, BREAKPOINT_MODES, OPENAI_BREAKPOINTS, OPENAI_WINDOW
from .response_store import ResponseStore

BLOCK_MODES = ("openai", "vllm")
CACHE_MODES = (*BLOCK_MODES, *BREAKPOINT_MODES)
BLOCK_SIZES = {"openai": 128, "vllm": 16, OPENAI_BREAKPOINTS: 1, ANTHROPIC: 1}
"""Tokens per prefix-cache block in each cache mode (the breakpoint modes cache exact
prefixes: a breakpoint is never rounded to a block)."""
MIN_CACHED_TOKENS = {"openai": 1024, "vllm": 0, OPENAI_BREAKPOINTS: 1024, ANTHROPIC: 1024}
"""Shortest prompt the cache serves in each mode (OpenAI: no hit below 1024 tokens)."""
REQUEST_LOG_SIZE = 1000
MODEL_ID = "kvwarm-sim"
"""The one model listed; also the ``model`` of replies to requests that name none."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """How the reference upstream behaves."""

    cache_mode: str = "openai"
    """``"openai"`` (128-token blocks, hits from 1024 tokens, prompts only),
    ``"vllm"`` (16-token blocks, the generated reply is cached too), or a breakpoint
    mode (:mod:`.markers`): ``"openai-breakpoints"`` (GPT-5.6 cache breakpoints,
    implicit and explicit) or ``"anthropic"`` (``cache_control`` markers)."""
    openhuman: bool = False
    """Add ``openhuman.usage`` / ``openhuman.billing`` blocks."""
    ttl_seconds: float = 3600.0
    """Block-cache TTL since last use (``openai`` and ``vllm`` modes; in the breakpoint
    modes each prefix has the TTL its request gave it)."""
    capacity_blocks: int = 200_000
    """LRU bound of the prefix cache, in blocks (used when ``kv_capacity_tokens`` is unset)."""
    kv_capacity_tokens: int | None = None
    """LRU bound of the prefix cache in tokens: it holds at most this many tokens' worth of
    blocks (``kv_capacity_tokens // block size``), as an engine's KV memory does; in the
    breakpoint modes, the written prefixes' lengths summed. ``None``: ``capacity_blocks``
    (practically unbounded)."""
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
    """USD per 1M cached input tokens (block modes; the breakpoint modes bill a read at a
    tenth of ``price_input`` and a write at a multiple of it: :mod:`.accounting`)."""
    price_output: float = 10.0
    """USD per 1M output tokens."""
    implicit_ttl_seconds: float | None = None
    """openai-breakpoints mode: the TTL of the implicit breakpoint. ``None``: the request's
    ``prompt_cache_options.ttl`` (30 minutes by default), as OpenAI documents for implicit
    and explicit breakpoints alike; set it (say 300) for an implicit cache that lives
    shorter than explicit breakpoints."""
    anthropic_usage: bool = False
    """Also report Anthropic's ``cache_read_input_tokens`` / ``cache_creation_input_tokens``
    in chat ``usage``, beside ``prompt_tokens_details`` (as some OpenRouter routes do)."""
    clock: SimClock | None = field(default=None, compare=False)
    """The clock every TTL runs on. ``None``: a fresh :class:`.clock.SimClock` (monotonic
    time, moved forward only by ``POST /sim/clock``). Hand one in to advance it in-process."""

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
        if self.implicit_ttl_seconds is not None and not self.implicit_ttl_seconds > 0:
            raise ValueError("implicit_ttl_seconds must be > 0")

    @property
    def block_size(self) -> int:
        """Tokens per prefix-cache block in this cache mode."""
        return BLOCK_SIZES[self.cache_mode]

    @property
    def breakpoints(self) -> bool:
        """A breakpoint mode: prefixes are cached where markers say (:mod:`.markers`)."""
        return self.cache_mode in BREAKPOINT_MODES

    @property
    def cache_blocks(self) -> int:
        """The prefix cache's capacity in blocks."""
        if self.kv_capacity_tokens is None:
            return self.capacity_blocks
        return self.kv_capacity_tokens // self.block_size


def cache_for(config: SimConfig) -> PrefixCache:
    """The block cache of ``config.cache_mode``, bounded as configured (idle in the breakpoint
    modes)."""
    return PrefixCache(
        config.block_size,
        MIN_CACHED_TOKENS[config.cache_mode],
        config.ttl_seconds,
        config.cache_blocks,
    )


def breakpoints_for(config: SimConfig) -> BreakpointCache:
    """The breakpoint cache of ``config.cache_mode`` (idle in the block modes): OpenAI reads a
    key's 80 most recent prefixes, Anthropic reads at its breakpoints."""
    window = OPENAI_WINDOW if config.cache_mode == OPENAI_BREAKPOINTS else None
    return BreakpointCache(window=window, capacity_tokens=config.kv_capacity_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceivedRequest:
    """One request to a model endpoint, as the reference upstream received it."""

    method: str
    path: str
    headers: dict[str, str]
    """Header names lower-cased."""
    body: bytes
    endpoint: str = "chat.completions"
    """Which API: ``"chat.completions"``, ``"responses"``, ``"messages"`` or
    ``"messages.count_tokens"``."""


@dataclass(slots=True, kw_only=True)
class SimState:
    """Everything the reference upstream remembers; lives in the app under :data:`SIM_STATE`."""

    config: SimConfig
    cache: PrefixCache
    """The block cache (``openai`` and ``vllm`` modes)."""
    breakpoints: BreakpointCache = field(default_factory=BreakpointCache)
    """The breakpoint cache (breakpoint modes)."""
    fingerprints: Fingerprints = field(default_factory=Fingerprints)
    """Responses' cache fingerprints, for ``prompt_cache_diagnostics``."""
    responses: ResponseStore = field(default_factory=ResponseStore)
    """Stored Responses (``store: true``), for ``previous_response_id`` and ``GET``."""
    requests: list[ReceivedRequest] = field(default_factory=list)
    """The last :data:`REQUEST_LOG_SIZE` model requests, most recent last."""
    clock: SimClock = field(default_factory=SimClock)
    """What every TTL runs on (:mod:`.clock`)."""

    @classmethod
    def create(cls, config: SimConfig) -> SimState:
        """A fresh state for ``config``."""
        return cls(
            config=config,
            cache=cache_for(config),
            breakpoints=breakpoints_for(config),
            responses=ResponseStore(config.stored_responses),
            clock=config.clock if config.clock is not None else SimClock(),
        )

    def record(self, request: ReceivedRequest) -> None:
        self.requests.append(request)
        if len(self.requests) > REQUEST_LOG_SIZE:
            del self.requests[: len(self.requests) - REQUEST_LOG_SIZE]

    def reset(self) -> None:
        """Forget everything: cached blocks and prefixes, stored Responses and their
        fingerprints, the request log. The clock keeps its time (it never goes back)."""
        self.cache.clear()
        self.breakpoints.clear()
        self.fingerprints.clear()
        self.responses.clear()
        self.requests.clear()


SIM_STATE: web.AppKey[SimState] = web.AppKey("sim_state", SimState)
