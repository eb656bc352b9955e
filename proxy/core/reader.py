"""The read side of the transcript tree the pure core needs: :class:`NodeReader`.

Its own module, plain Python: :mod:`proxy.core.model` is compiled (``proxy/native.py``), and a
protocol compiled by mypyc carries mypyc's own attributes, which ``isinstance`` against a
runtime-checkable protocol built on it (the stores', :mod:`proxy.store.base`) would then require.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .model import Node

__all__ = ["NodeReader"]


@runtime_checkable
class NodeReader(Protocol):
    """The read side the pure core needs. Synchronous: served from memory."""

    def get(self, key: bytes) -> Node | None: ...

    def children(self, key: bytes) -> Sequence[Node]:
        """Stored children of ``key`` (a node key or a tenant root), oldest first."""
        ...

    def by_identity(self, tenant: bytes, identity: bytes) -> Sequence[Node]:
        """Stored nodes of ``tenant`` whose element identity is ``identity`` (any depth)."""
        ...
