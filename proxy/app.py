"""The aiohttp application: routes, error conversion, and the resources each app owns.

``create_app(settings)`` builds everything from one frozen :class:`~proxy.config.Settings`;
nothing is global. Resources live under typed :class:`web.AppKey` keys and are
opened and closed in ``cleanup_ctx``: the pooled upstream transport, the
transcript store, the token counter, and the maintenance task (eviction and
store gauges); then the keep-alive's task, when enabled (:mod:`proxy.keepalive`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import hdrs, web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from . import __version__
from .appkeys import ACTIVITY, HISTORY, METRICS, PIPELINE, PRICES, READY, REGISTRY, SETTINGS, STORE
from .config import Settings
from .core.pricing import PriceTable
from .edge.defences import body_arrived, check_path, read_body, send_and_close, shown_path
from .errors import MetricsUnauthorized, ProxyError, error_body
from .keepalive import KEEPALIVE_CLOCK, keepalive_ctx
from .metrics import ProxyMetrics
from .ops.admin import add_admin_routes
from .request.pipeline import Pipeline
from .routing import affinity_for
from .store.base import AsyncStore, TranscriptStore
from .store.factory import make_store
from .store.local import LocalStore
from .store.tokens import TokenCounter
from .store.urls import redacted
from .transport.client import Upstream
from .transport.pool import Transport
from .web.activity import Activity
from .web.history import History
from .web.routes import add_web_routes

log = logging.getLogger(__name__)


MAINTENANCE_INTERVAL = 15.0
GAUGE_INTERVAL = 1.0
"""Seconds between two refreshes of a worker's scrape-time gauges when several workers share
``/metrics`` (another worker's scrape reads them from this worker's files)."""


def error_response(status: int, message: str, error_type: str, code: str) -> web.Response:
    """The one place an error becomes an OpenAI-shaped JSON body."""
    return web.Response(status=status, body=error_body(message, error_type, code), content_type="application/json")


@web.middleware
async def edge_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Before any handler runs, the edge's checks (:mod:`proxy.edge.defences`): the path, then the whole
    body within its size and time limits. A :class:`ProxyError`, a refusal of theirs or a
    handler's, becomes an OpenAI-shaped error. One middleware, not two: each costs every
    request a coroutine and a call through aiohttp's chain."""
    try:
        check_path(request.raw_path, request.path)
        settings = request.app[SETTINGS].server
        if body_arrived(request, settings) is None:
            await read_body(request, settings)
        return await handler(request)
    except ProxyError as exc:
        log.warning("%s %s -> %d %s", request.method, shown_path(request), exc.status, exc)
        response = error_response(exc.status, str(exc), exc.error_type, exc.code)
        if exc.close_connection:
            await send_and_close(request, response)
        return response


def create_app(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    store: TranscriptStore | AsyncStore | None = None,
    prices: PriceTable | None = None,
    clock: Callable[[], float] | None = None,
) -> web.Application:
    """Build the proxy app. Tests inject a fresh registry and, when they want, a store
    (a local one is wrapped in :class:`LocalStore`) and the keep-alive's clock (default: the
    event loop's time; :mod:`proxy.keepalive`)."""
    app = web.Application(
        client_max_size=settings.server.max_body_bytes,
        middlewares=[edge_middleware],
    )
    registry = registry if registry is not None else CollectorRegistry()
    app[SETTINGS] = settings
    app[REGISTRY] = registry
    app[METRICS] = ProxyMetrics(registry, max_models=settings.metrics.max_models)
    if store is None:
        app[STORE] = make_store(settings.store)
    else:
        app[STORE] = store if isinstance(store, AsyncStore) else LocalStore(store)
    if prices is None:
        prices = settings.metrics.prices()
    app[PRICES] = prices
    app[READY] = asyncio.Event()
    if clock is not None:
        app[KEEPALIVE_CLOCK] = clock
    app.cleanup_ctx.append(_resources)
    app.cleanup_ctx.append(keepalive_ctx)  # after the resources it uses; stopped before them
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if settings.metrics.enabled:
        app.router.add_get(settings.metrics.path, metrics_endpoint)
    add_admin_routes(app)
    app[ACTIVITY] = Activity()  # the /kvwarm/ page: break examples, counter history, its routes and sampler
    app[HISTORY] = History(started=time.time())
    add_web_routes(app)
    app.router.add_route("*", "/v1/{tail:.*}", proxy_handler)
    app.router.add_route("*", "/v1", proxy_handler)
    return app


async def _resources(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    store = app[STORE]
    transport = Transport(limit=settings.upstream.max_connections, connect_timeout=settings.upstream.connect_timeout)
    tokens_task = asyncio.create_task(asyncio.to_thread(TokenCounter))
    try:
        await store.open()
        tokens = await tokens_task
    except BaseException:
        await transport.close()
        raise
    app[PIPELINE] = Pipeline(
        settings, Upstream(transport, settings.upstream), store, app[METRICS], app[PRICES], tokens,
        breaks=app[ACTIVITY],
    )
    router = app[PIPELINE].router  # a shared store shares the affinity: every process routes alike
    router.affinity = affinity_for(store, settings.routing, len(router.replicas))
    maintenance = asyncio.create_task(_maintain(app), name="kvwarm-maintenance")
    app[METRICS].track_store(store.stats)
    app[READY].set()
    log.info(
        "kvwarm %s ready: upstream %s, store %s",
        __version__, ", ".join(settings.upstream.base_url), redacted(settings.store.backend),
    )
    try:
        yield
    finally:
        app[READY].clear()
        maintenance.cancel()
        await asyncio.gather(maintenance, return_exceptions=True)
        # The last loop iteration's reports, before the store closes.
        app[PIPELINE].reporter.flush()
        try:
            await store.close()
        finally:
            await transport.close()


async def _maintain(app: web.Application) -> None:
    """Evict expired and over-budget nodes. The store gauges are read at scrape time; with several
    workers (metrics in multiprocess mode) this task sets them every :data:`GAUGE_INTERVAL`."""
    store, metrics = app[STORE], app[METRICS]
    multiprocess = metrics.multiprocess
    tick = GAUGE_INTERVAL if multiprocess else MAINTENANCE_INTERVAL
    ticks_per_eviction = max(1, round(MAINTENANCE_INTERVAL / tick))
    ticks = 0
    while True:
        await asyncio.sleep(tick)
        ticks += 1
        if multiprocess:
            try:
                metrics.refresh_gauges()
            except Exception:
                log.exception("refreshing the store gauges failed")
                metrics.error("store")
        if ticks % ticks_per_eviction:
            continue
        try:
            store.evict(time.time())
        except Exception:
            log.exception("store maintenance failed")
            metrics.error("store")


async def proxy_handler(request: web.Request) -> web.StreamResponse:
    return await request.app[PIPELINE].handle(request)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "version": __version__})


async def readyz(request: web.Request) -> web.Response:
    if not request.app[READY].is_set():
        return web.json_response({"status": "starting"}, status=503)
    store = request.app[STORE]
    health = store.health()
    # A degraded store (a shared one out of reach) still serves: requests go upstream unrepaired.
    status = "ready" if health == "ok" else "degraded"
    return web.json_response({"status": status, "store": health, "store_nodes": store.stats().nodes})


async def metrics_endpoint(request: web.Request) -> web.Response:
    token = request.app[SETTINGS].metrics.token
    if token:
        scheme, _, presented = request.headers.get(hdrs.AUTHORIZATION, "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), token.encode()):
            raise MetricsUnauthorized("the metrics need 'Authorization: Bearer <metrics.token>'")
    metrics = request.app[METRICS]
    if metrics.multiprocess:
        # Several workers: this worker's scrape-time gauges now, then every worker's files added up.
        metrics.refresh_gauges()
        body = generate_latest(metrics.exposition())
    else:
        body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
