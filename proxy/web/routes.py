"""The aiohttp edge of the dashboard: its routes and the sampler task the app owns.

Routes (on the proxy port)::

    GET /kvwarm/                    the page (server-rendered HTML; the script keeps it fresh)
    GET /kvwarm                     redirects to /kvwarm/
    GET /kvwarm/api/overview        what the page shows, as JSON (the script polls it)
    GET /kvwarm/static/{name}       the page's script, stylesheet and icon (from this package)

A store that cannot answer (a shared one out of reach) never fails the page or the API: they
answer 200 with the process's own figures, no sessions, and ``store.available`` false with a
message the page shows in a banner (:mod:`proxy.web.overview`).

The page and the API answer under the admin API's access rule, decided by
:func:`proxy.ops.admin.decide_access` (loopback, the admin token, or a tenant's own key
that sees only its own sessions and break examples; see :mod:`proxy.web.overview`
for what a tenant sees). The static files hold no data and are served to anyone who
can reach the port.

:func:`add_web_routes` also appends to ``cleanup_ctx`` the owned task that samples the
counters into the app's :class:`~proxy.web.history.History` once a minute; each page
read samples too, so the current minute is live. The counters are read afresh on every
request; the session list at a bounded cost (:class:`SessionReads`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from importlib import resources

import orjson
from aiohttp import hdrs, web

from .. import __version__
from ..appkeys import ACTIVITY, HISTORY, PIPELINE, REGISTRY, SETTINGS, STORE
from ..edge.tenancy import UNKNOWN_TENANT
from ..errors import StoreError
from ..ops.admin import decide_access
from ..store.base import AsyncStore, SessionInfo
from .activity import Activity
from .counters import read_counters
from .overview import Viewer, build_overview, preview_of, top_sessions
from .page import CSP, render_page
from .view import build_view

__all__ = ["API_PATH", "PAGE_PATH", "POLL_SECONDS", "SessionReads", "add_web_routes", "sample_history"]

log = logging.getLogger(__name__)

PAGE_PATH = "/kvwarm/"
API_PATH = "/kvwarm/api/overview"
STATIC_PREFIX = "/kvwarm/static/"
POLL_SECONDS = 5.0
"""How often the page polls the API."""
SAMPLE_OFFSET = 0.5
"""Seconds past each minute at which the sampler reads the counters."""
REUSE_FACTOR = 20.0
"""A session listing is reused for this many times as long as it took to read."""
MAX_CACHED_VIEWERS = 64

_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
_SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class _Asset:
    body: bytes
    content_type: str
    etag: str


def _load_assets() -> dict[str, _Asset]:
    folder = resources.files(__package__).joinpath("static")
    assets = {}
    for entry in folder.iterdir():
        suffix = os.path.splitext(entry.name)[1]
        if suffix in _TYPES:
            body = entry.read_bytes()
            assets[entry.name] = _Asset(body=body, content_type=_TYPES[suffix], etag='"' + hashlib.sha256(body).hexdigest()[:16] + '"')
    return assets


@dataclass(frozen=True, slots=True, kw_only=True)
class _Assets:
    by_name: Mapping[str, _Asset]


_ASSETS = web.AppKey("kvwarm_web_assets", _Assets)


def _viewer(request: web.Request) -> Viewer:
    """Who is looking. A tenant whose root the store cannot derive yet (its secret is unknown)
    is a tenant all the same, named :data:`~proxy.edge.tenancy.UNKNOWN_TENANT`: it sees nothing."""
    try:
        access = decide_access(request.remote, request.headers, request.app[SETTINGS], request.app[STORE].secret)
    except StoreError:
        return Viewer(tenant=UNKNOWN_TENANT, why="tenant")
    return Viewer(tenant=access.tenant, why=access.why)


class SessionReads:
    """The viewer's sessions and the previews of the top ones, re-read at a bounded cost.

    Listing the store's sessions is linear in their number and runs on the event loop
    (about a second for 100 000 sessions in memory). A read is reused for
    :data:`REUSE_FACTOR` times as long as it took, so polling pages never spend more than
    about 1/REUSE_FACTOR of the loop on it: a small store is read afresh on every poll,
    a huge one every few tens of seconds.
    """

    __slots__ = ("_cache", "_clock")

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._cache: OrderedDict[bytes | None, tuple[float, float, list[SessionInfo], dict[bytes, str]]] = OrderedDict()

    async def read(self, store: AsyncStore, tenant: bytes | None) -> tuple[list[SessionInfo], dict[bytes, str]]:
        started = self._clock()
        hit = self._cache.get(tenant)
        if hit is not None and started - hit[0] < hit[1] * REUSE_FACTOR:
            return hit[2], hit[3]
        infos = await store.sessions(tenant)
        previews = {i.leaf: preview_of(await store.path(i.leaf, i.tenant)) for i in top_sessions(infos)}
        self._cache[tenant] = (started, self._clock() - started, infos, previews)
        self._cache.move_to_end(tenant)
        while len(self._cache) > MAX_CACHED_VIEWERS:
            self._cache.popitem(last=False)
        return infos, previews


_SESSIONS = web.AppKey("kvwarm_web_sessions", SessionReads)


async def _overview(request: web.Request, viewer: Viewer) -> dict[str, object]:
    app = request.app
    now = time.time()
    reading = read_counters(app[REGISTRY])
    history = app[HISTORY]
    history.record(reading.totals, now)
    infos, previews, store_error = await _sessions_of(app, viewer)
    # The replicas: the router's live view once the pipeline exists, the configured URLs before.
    pipeline = app.get(PIPELINE)
    settings = app[SETTINGS]
    upstreams = (
        pipeline.router.describe()
        if pipeline is not None
        else [{"url": url, "state": "starting"} for url in settings.upstream.base_url]
    )
    return build_overview(
        viewer=viewer,
        reading=reading,
        history=history,
        # A tenant not named yet has no examples: none were recorded under a tenant of its own.
        activity=Activity() if viewer.tenant == UNKNOWN_TENANT else app[ACTIVITY],
        sessions=infos,
        previews=previews,
        upstreams=upstreams,
        routing=settings.routing.policy,
        now=now,
        pid=os.getpid(),
        version=__version__,
        workers=settings.server.workers,
        store_error=store_error,
        store_health=app[STORE].health(),
    )


async def _sessions_of(
    app: web.Application, viewer: Viewer
) -> tuple[list[SessionInfo], dict[bytes, str], str | None]:
    """The viewer's sessions and previews, or none and why the store cannot give them."""
    if viewer.tenant == UNKNOWN_TENANT:
        return [], {}, "its shared secret is not known yet: it has not answered since this process started"
    try:
        infos, previews = await app[_SESSIONS].read(app[STORE], viewer.tenant)
    except StoreError as exc:
        log.debug("the dashboard's session read failed: %s", exc)  # polled: the store's own log says it once
        return [], {}, str(exc)
    return infos, previews, None


async def page(request: web.Request) -> web.Response:
    viewer = _viewer(request)
    overview = await _overview(request, viewer)
    assets = request.app[_ASSETS].by_name
    urls = {name: f"{STATIC_PREFIX}{name}?v={asset.etag.strip(chr(34))}" for name, asset in assets.items()}
    html = render_page(
        build_view(overview),
        operator=viewer.tenant is None,
        assets=urls,
        api=API_PATH,
        interval_ms=int(POLL_SECONDS * 1000),
    )
    return web.Response(text=html, content_type="text/html", charset="utf-8", headers=_SECURITY_HEADERS)


async def api_overview(request: web.Request) -> web.Response:
    overview = await _overview(request, _viewer(request))
    overview["view"] = build_view(overview)
    return web.Response(body=orjson.dumps(overview), content_type="application/json", headers=_SECURITY_HEADERS)


async def static(request: web.Request) -> web.Response:
    asset = request.app[_ASSETS].by_name.get(request.match_info["name"])
    if asset is None:
        raise web.HTTPNotFound()
    headers = {
        hdrs.ETAG: asset.etag,
        hdrs.CACHE_CONTROL: "no-cache",
        "X-Content-Type-Options": "nosniff",
    }
    if request.headers.get(hdrs.IF_NONE_MATCH) == asset.etag:
        return web.Response(status=304, headers=headers)
    return web.Response(body=asset.body, content_type=asset.content_type, charset="utf-8", headers=headers)


async def redirect(request: web.Request) -> web.Response:
    raise web.HTTPFound(PAGE_PATH)


async def _sample_every_minute(app: web.Application) -> None:
    history, registry = app[HISTORY], app[REGISTRY]
    while True:
        await asyncio.sleep(60.0 - time.time() % 60.0 + SAMPLE_OFFSET)
        try:
            history.record(read_counters(registry).totals, time.time())
        except Exception:  # a collector that fails must not end the sampling
            log.exception("sampling the counters for the dashboard failed")


async def sample_history(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: a first reading at start-up, then one a minute until the app stops."""
    app[HISTORY].record(read_counters(app[REGISTRY]).totals, time.time())
    task = asyncio.create_task(_sample_every_minute(app), name="kvwarm-web-history")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def add_web_routes(app: web.Application) -> None:
    """Called by :func:`proxy.app.create_app` once ``app[HISTORY]`` and ``app[ACTIVITY]`` exist."""
    app[_ASSETS] = _Assets(by_name=_load_assets())
    app[_SESSIONS] = SessionReads()
    app.router.add_get(PAGE_PATH, page)
    app.router.add_get(PAGE_PATH.rstrip("/"), redirect)
    app.router.add_get(API_PATH, api_overview)
    app.router.add_get(STATIC_PREFIX + "{name}", static)
    app.cleanup_ctx.append(sample_history)
