"""The keep-alive's place in the app: its key, its clock, and the task that sends its pings.

:func:`keepalive_ctx` is one of the app's ``cleanup_ctx``: when ``keepalive.enabled``, it makes
the :class:`~proxy.keepalive.keeper.KeepAlive` (on the clock under :data:`KEEPALIVE_CLOCK`, else
the event loop's time), hands it to the pipeline and starts its task; at shutdown it stops the
pipeline noting turns, cancels the task and awaits it, and drops every credential it held.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from ..appkeys import METRICS, PIPELINE, PRICES, SETTINGS
from .keeper import KeepAlive

__all__ = ["KEEPALIVE", "KEEPALIVE_CLOCK", "keepalive_ctx"]

KEEPALIVE = web.AppKey("keepalive", KeepAlive)
"""The app's keep-alive, while it runs (absent when ``keepalive.enabled`` is false)."""
KEEPALIVE_CLOCK: web.AppKey[Callable[[], float]] = web.AppKey("keepalive_clock")
"""The clock the keep-alive runs on, when not the event loop's (tests and the bench move it)."""


async def keepalive_ctx(app: web.Application) -> AsyncIterator[None]:
    """Run the keep-alive while the app runs (after the app's resources are open)."""
    settings = app[SETTINGS]
    if not settings.keepalive.enabled:
        yield
        return
    pipeline = app[PIPELINE]
    clock = app.get(KEEPALIVE_CLOCK) or asyncio.get_running_loop().time
    keeper = KeepAlive(
        settings.keepalive, prices=app[PRICES], metrics=app[METRICS], clock=clock,
        health_clock=pipeline.router.clock, api_key=settings.upstream.api_key, workers=settings.server.workers,
    )
    app[KEEPALIVE] = keeper
    pipeline.keepalive = keeper
    task = asyncio.create_task(keeper.run(), name="kvwarm-keepalive")
    try:
        yield
    finally:
        pipeline.keepalive = None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await keeper.close()
