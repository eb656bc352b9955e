"""The ``/kvwarm/`` admin API: who may see which sessions, and the routes that show them.

Routes (on the proxy port)::

    GET /kvwarm/sessions[?limit=N]          list, most recently updated first (limit 1..10000, default 1000)
    GET /kvwarm/sessions/{id}               one session as JSON (summary + elements, bodies byte-exact)
    GET /kvwarm/sessions/{id}.md            one session as a Markdown transcript
    GET /kvwarm/sessions/{id}?format=md     the same (format=json is the default)

``{id}`` is a session id from the list (32 hex digits) or a unique prefix of at least 4.

Access: the first rule that applies decides.

1. ``Authorization: Bearer <admin.token>`` (``admin.token`` set; compared in constant
   time): every session, from any address.
2. A tenant credential -- the value the pipeline keys tenants by: the
   ``store.tenant_header`` header when configured, else ``Authorization`` -- present and
   not empty: that tenant's sessions only (others answer 404, as if absent). From a
   loopback client always. From any other address only when all of these hold, since
   the credential must then prove who is asking: ``admin.token`` is set (the operator
   opened the API beyond loopback), tenants are keyed by ``Authorization`` (a tenant
   header is a name anyone can send), and ``upstream.api_key`` is empty (then the
   provider checks that very key on every chat request; with a shared upstream key,
   the client's ``Authorization`` is never checked by anyone). A wrong admin token is
   just some tenant's key here: it sees that tenant's sessions (usually none), never all.
3. A loopback client without a credential: every session (the operator on the host).
4. Anything else: 401, as an OpenAI-style JSON error.

Loopback means ``request.remote`` is a loopback address (127.0.0.0/8, ``::1``,
``::ffff:127.x``) *and* the request carries no ``Forwarded`` / ``X-Forwarded-For`` /
``X-Real-IP`` header: a reverse proxy on the same host connects from loopback on
behalf of remote clients, and its requests must not pass as the operator's. A
loopback client adding such a header only lowers its own rights.

A store that cannot answer (a shared store out of reach, or one whose secret is not known
yet, so that no tenant can be named) makes the sessions routes answer 503
``store_unavailable``, an OpenAI-style JSON error: an empty list would read as "no
sessions". Requests are still served meanwhile, unrepaired. The operator's message says why.

Caveat of rule 2: a tenant whose key is guessable (``EMPTY`` with a local engine
that checks no keys) can be read by whoever guesses it, once the API is opened
beyond loopback; keep such deployments on loopback or behind the admin token only.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aiohttp import hdrs, web

from ..appkeys import PIPELINE, SETTINGS, STORE
from ..config import Settings
from ..core import transcript_md
from ..core.model import tenant_root
from ..edge.tenancy import tenant_credential
from ..errors import (
    AdminBadRequest,
    AdminUnauthorized,
    SessionNotFound,
    StoreError,
    StoreUnavailable,
)
from . import sessions

__all__ = ["Access", "AdminUnauthorized", "add_admin_routes", "decide_access", "is_loopback"]

PREFIX = "/kvwarm"
DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000
MD_SUFFIX = ".md"
MARKDOWN = "text/markdown"
PROXY_HEADERS = (hdrs.FORWARDED, hdrs.X_FORWARDED_FOR, "X-Real-IP")


@dataclass(frozen=True, slots=True, kw_only=True)
class Access:
    tenant: bytes | None
    """The only tenant whose sessions may be seen; None: every tenant."""
    why: str
    """Which rule granted it: ``admin-token``, ``tenant`` or ``loopback``."""


def is_loopback(remote: str | None) -> bool:
    """True for 127.0.0.0/8, ``::1`` and IPv4-mapped loopback; False for anything unparsable."""
    if not remote:
        return False
    try:
        address = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _bearer(authorization: str) -> str | None:
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def decide_access(
    remote: str | None, headers: Mapping[str, str], settings: Settings, secret: Callable[[], bytes]
) -> Access:
    """Apply the module's access rules to one request; raises :class:`AdminUnauthorized`.

    ``secret`` (the store's) is asked only when a tenant credential decides: it raises
    :class:`StoreError` while a shared store's secret is unknown."""
    token = settings.admin.token
    presented = _bearer(headers.get(hdrs.AUTHORIZATION, ""))
    if token and presented is not None and hmac.compare_digest(presented.encode(), token.encode()):
        return Access(tenant=None, why="admin-token")
    local = is_loopback(remote) and not any(h in headers for h in PROXY_HEADERS)
    tenant_header = settings.store.tenant_header
    credential = tenant_credential(headers, tenant_header)
    if credential:
        if local or (token and not tenant_header and not settings.upstream.api_key):
            return Access(tenant=tenant_root(secret(), credential), why="tenant")
        if not token:
            raise AdminUnauthorized(
                "the kvwarm admin API answers loopback clients only; set admin.token to open it"
            )
        raise AdminUnauthorized("this credential does not open the kvwarm admin API from this address")
    if local:
        return Access(tenant=None, why="loopback")
    raise AdminUnauthorized("the kvwarm admin API needs 'Authorization: Bearer <admin.token>' from this address")


def _access(request: web.Request) -> Access:
    try:
        return decide_access(request.remote, request.headers, request.app[SETTINGS], request.app[STORE].secret)
    except StoreError as exc:
        raise _unavailable(exc, operator=False) from exc


def _unavailable(exc: StoreError, *, operator: bool) -> StoreUnavailable:
    """The 503 of a store that cannot answer; the operator reads why (a tenant does not: the
    store's address and state are the operator's)."""
    why = f" ({exc})" if operator else ""
    return StoreUnavailable(
        f"the session store is unavailable right now{why}; requests are still served (unrepaired), "
        "and sessions can be read again once the store answers"
    )


async def list_sessions(request: web.Request) -> web.Response:
    access = _access(request)
    raw = request.query.get("limit", str(DEFAULT_LIMIT))
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_LIMIT:
        raise AdminBadRequest(f"limit must be a whole number from 1 to {MAX_LIMIT}")
    try:
        infos = await request.app[STORE].sessions(access.tenant)
    except StoreError as exc:
        raise _unavailable(exc, operator=access.tenant is None) from exc
    return web.Response(body=sessions.list_json(infos, int(raw)), content_type="application/json")


async def show_session(request: web.Request) -> web.Response:
    access = _access(request)
    name = request.match_info["id"]
    fmt = request.query.get("format", "json")
    if name.endswith(MD_SUFFIX):
        name, fmt = name[: -len(MD_SUFFIX)], "md"
    if fmt not in ("json", "md"):
        raise AdminBadRequest("format must be json or md")
    store = request.app[STORE]
    try:
        leaf = await sessions.find_session(store, name, access.tenant)
        transcript = await sessions.load_session(store, leaf, access.tenant) if leaf is not None else None
    except StoreError as exc:
        raise _unavailable(exc, operator=access.tenant is None) from exc
    if transcript is None:
        raise SessionNotFound(f"no session {name!r}")
    transcript = await request.app[PIPELINE].counted_transcript(transcript)  # a node may be stored uncounted
    if fmt == "md":
        return web.Response(text=transcript_md.render(transcript), content_type=MARKDOWN, charset="utf-8")
    return web.Response(body=sessions.session_json(transcript), content_type="application/json")


def add_admin_routes(app: web.Application) -> None:
    """Called by :func:`proxy.app.create_app`."""
    app.router.add_get(f"{PREFIX}/sessions", list_sessions)
    app.router.add_get(PREFIX + "/sessions/{id}", show_session)
