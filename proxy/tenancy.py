"""Which tenant a request belongs to: the HTTP edge of the tenant rule.

A tenant is named by a credential: the configured ``store.tenant_header``, else
``Authorization`` (``""`` when absent: the anonymous tenant). Its chain root is a
keyed hash of that value (:func:`proxy.core.model.tenant_root`); the raw value is
never stored or logged. The proxy and the admin API both use this one rule.
"""

from __future__ import annotations

from collections.abc import Mapping

from .core.model import tenant_root

__all__ = ["TenantRoots", "tenant_credential"]


def tenant_credential(headers: Mapping[str, str], tenant_header: str = "") -> str:
    """The value that names a request's tenant (``""``: the anonymous tenant)."""
    return headers.get(tenant_header or "Authorization", "")


class TenantRoots:
    """Tenant roots by credential, memoized (an HMAC per request is measurable at 2 KiB)."""

    _LIMIT = 10_000

    def __init__(self, secret: bytes, tenant_header: str = "") -> None:
        self._secret = secret
        self._header = tenant_header
        self._roots: dict[str, bytes] = {}

    def of(self, headers: Mapping[str, str]) -> bytes:
        credential = tenant_credential(headers, self._header)
        root = self._roots.get(credential)
        if root is None:
            if len(self._roots) >= self._LIMIT:
                self._roots.clear()
            root = self._roots[credential] = tenant_root(self._secret, credential)
        return root
