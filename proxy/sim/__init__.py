"""The reference upstream: a small OpenAI- and Anthropic-compatible provider emulator for tests, benchmarks and demos.

- :mod:`.state` — configuration (:class:`SimConfig`) and what the emulator remembers;
- :mod:`.clock` — the clock every TTL runs on, which tests and the bench can advance;
- :mod:`.render` — the chat template (messages and tools -> prompt text -> tokens);
- :mod:`.items` — the Responses API's input items, instructions and tools -> the chat template;
- :mod:`.content_blocks` — the Messages API's system, content blocks and tools -> the chat template;
- :mod:`.prompt` — a rendered prompt (tokens, block hashes or cache plan, seed) and request parsing;
- :mod:`.cache` — the block cache of the ``openai`` and ``vllm`` modes (chained block hashes,
  LRU bounded by capacity, TTL);
- :mod:`.markers` / :mod:`.layout` / :mod:`.breakpoint_cache` — the breakpoint modes
  (``openai-breakpoints``, ``anthropic``): cache markers and the plan they make, where each
  marked block ends in tokens, the written prefixes;
- :mod:`.diagnostics` — ``prompt_cache_diagnostics`` (openai-breakpoints, Responses);
- :mod:`.engine` — prefill against the cache, time to first token, KV of generated tokens;
- :mod:`.replies` — chat replies: deterministic messages, tool calls and their stream deltas;
- :mod:`.script` — the Responses script: one tool call, then a final message;
- :mod:`.message_script` — the Messages script: a tool use, then text; signed thinking;
- :mod:`.outputs` / :mod:`.events` — Responses output items, response object, stream events;
- :mod:`.message_events` — the Messages API's ``message`` object and stream events;
- :mod:`.sealed` — the opaque ``encrypted_content`` of reasoning items (and thinking signatures);
- :mod:`.response_store` — stored Responses (``store``, ``previous_response_id``);
- :mod:`.accounting` — token counts and the usage / ``openhuman`` blocks;
- :mod:`.steering` / :mod:`.faults` — the ``x-sim-*`` headers and injected faults;
- :mod:`.wire` — errors (OpenAI's and Anthropic's), JSON bodies and the SSE writer shared by
  the endpoints;
- :mod:`.server` — the aiohttp app and the chat endpoint; :mod:`.responses` — the Responses
  endpoint; :mod:`.messages` — the Messages endpoints.

Start one with ``web.run_app(create_sim_app(SimConfig(...)), host=..., port=...)``,
``asyncio.run(serve_sim(host, port, config))``, or in-process with
``async with running_sim(config) as base_url: ...``.
"""

from __future__ import annotations

from .clock import SimClock
from .server import (
    SIM_STATE,
    ReceivedRequest,
    SimConfig,
    SimState,
    create_sim_app,
    running_sim,
    serve_sim,
)

__all__ = [
    "SIM_STATE",
    "ReceivedRequest",
    "SimClock",
    "SimConfig",
    "SimState",
    "create_sim_app",
    "running_sim",
    "serve_sim",
]
