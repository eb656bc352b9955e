"""The reference upstream: a small OpenAI-compatible provider emulator for tests, benchmarks and demos.

- :mod:`.render` — the chat template (messages and tools -> prompt text -> tokens);
- :mod:`.cache` — the prefix cache (chained block hashes, LRU, TTL);
- :mod:`.replies` — deterministic replies, tool calls and their stream deltas;
- :mod:`.server` — the aiohttp app: routes, usage, time to first token, faults.

Start one with ``web.run_app(create_sim_app(SimConfig(...)), host=..., port=...)``,
``asyncio.run(serve_sim(host, port, config))``, or in-process with
``async with running_sim(config) as base_url: ...``.
"""

from __future__ import annotations

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
    "SimConfig",
    "SimState",
    "create_sim_app",
    "running_sim",
    "serve_sim",
]
