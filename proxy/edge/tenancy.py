"""Which tenant a request belongs to: the HTTP edge of the tenant rule.

A tenant is named by a credential: the configured ``store.tenant_header``, else
``Authorization``, else Anthropic's ``x-api-key`` (what Claude Code and the ``anthropic`` SDKs
send), read as the bearer token it is: ``x-api-key: K`` names the tenant that
``Authorization: Bearer K`` names, so a key keeps its sessions whichever header a client puts it
in (``""`` when there is none: the anonymous tenant). Its chain root is a
keyed hash of that value (:func:`proxy.core.model.tenant_root`); the raw value is
never stored or logged. The proxy and the admin API both use this one rule.

The key is the store's secret as it stands now: a shared store agrees on it with the
other processes and may not know it yet (Redis has not answered since the start) or
follow another one later (Redis lost it: :mod:`proxy.store.redis.secret`). So the roots are
derived from the store's current secret, and while it is unknown no tenant can be named:
every request gets :data:`UNKNOWN_TENANT`, under which nothing is matched or recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..core.model import tenant_root
from ..errors import StoreError

__all__ = ["API_KEY_HEADER", "UNKNOWN_TENANT", "TenantRoots", "tenant_credential"]

UNKNOWN_TENANT = b""
"""The root of every request while the store's secret is unknown. A shared store refuses to
read or write under it (a turn keyed under no secret could never be matched by another
process), so such requests are forwarded unrepaired; it is no HMAC, so no tenant has it."""


API_KEY_HEADER = "x-api-key"
"""Anthropic's credential header (the Messages API's ``Authorization: Bearer`` alternative)."""


def tenant_credential(headers: Mapping[str, str], tenant_header: str = "") -> str:
    """The value that names a request's tenant (``""``: the anonymous tenant)."""
    if tenant_header:
        return headers.get(tenant_header, "")
    authorization = headers.get("Authorization", "")
    if authorization:
        return authorization
    key = headers.get(API_KEY_HEADER, "")
    return "Bearer " + key if key else ""


class TenantRoots:
    """Tenant roots by credential, memoized (an HMAC per request is measurable at 2 KiB).

    ``secret``: the store's :meth:`~proxy.store.base.AsyncStore.secret`. A ``shared`` store's
    is asked on every request (it may change, and raises :class:`StoreError` while unknown; the
    memo is emptied when it changes); a local store's never changes and is asked once, here."""

    _LIMIT = 10_000

    def __init__(self, secret: Callable[[], bytes], tenant_header: str = "", *, shared: bool = True) -> None:
        self._secret_of = secret
        self._shared = shared
        self._secret = UNKNOWN_TENANT if shared else secret()
        self._header = tenant_header
        self._roots: dict[str, bytes] = {}

    def of(self, headers: Mapping[str, str]) -> bytes:
        secret = self._secret
        if self._shared:
            try:
                secret = self._secret_of()
            except StoreError:
                return UNKNOWN_TENANT
            if secret != self._secret:
                self._roots.clear()
                self._secret = secret
        credential = tenant_credential(headers, self._header)
        root = self._roots.get(credential)
        if root is None:
            if len(self._roots) >= self._LIMIT:
                self._roots.clear()
            root = self._roots[credential] = tenant_root(secret, credential)
        return root
