"""Stored Responses (``store: true``): what ``previous_response_id`` and ``GET /v1/responses/{id}`` read.

A bounded, in-memory, insertion-ordered map: beyond ``capacity`` the oldest
response is forgotten (with its output items). Each stored response keeps

- its *effective* input: the previous response's effective input and output
  followed by the request's own input (``previous_response_id`` chains are
  resolved when stored, so a lookup never walks the chain);
- its output items in the provider's own form: a ``reasoning`` item always
  carries its sealed ``encrypted_content`` here, even when the client did not
  ask to see it (the provider keeps the reasoning it generated);
- the response object as it was returned, for ``GET``.

Output items are indexed by ``id`` so that an ``item_reference``, or a
``reasoning`` item sent back without its ``encrypted_content``, can be
resolved as the provider resolves stored items.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredResponse:
    """One stored response."""

    id: str
    effective_input: tuple[Mapping[str, Any], ...]
    """Every input item the response was generated from, chain resolved."""
    output: tuple[Mapping[str, Any], ...]
    """The output items, reasoning sealed in ``encrypted_content``."""
    public: Mapping[str, Any]
    """The response object as returned to the client."""


class ResponseStore:
    """Stored responses by id, oldest forgotten first beyond ``capacity``."""

    __slots__ = ("_items", "_responses", "capacity")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._items: dict[str, Mapping[str, Any]] = {}
        """Output item id -> item, for the stored responses only."""

    def __len__(self) -> int:
        return len(self._responses)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or ``None`` (never stored, ``store: false``, or forgotten)."""
        return self._responses.get(response_id)

    def item(self, item_id: str) -> Mapping[str, Any] | None:
        """A stored output item by its ``id``, or ``None``."""
        return self._items.get(item_id)

    def put(self, stored: StoredResponse) -> None:
        """Keep ``stored``; forget the oldest responses beyond the capacity."""
        self._responses[stored.id] = stored
        for item in stored.output:
            item_id = item.get("id")
            if isinstance(item_id, str):
                self._items[item_id] = item
        while len(self._responses) > self.capacity:
            _, oldest = self._responses.popitem(last=False)
            self._forget_items(oldest.output)

    def discard(self, response_id: str) -> None:
        """Forget one response (a stream that never completed)."""
        stored = self._responses.pop(response_id, None)
        if stored is not None:
            self._forget_items(stored.output)

    def clear(self) -> None:
        self._responses.clear()
        self._items.clear()

    def _forget_items(self, items: Sequence[Mapping[str, Any]]) -> None:
        for item in items:
            item_id = item.get("id")
            if isinstance(item_id, str):
                self._items.pop(item_id, None)


class PreviousResponseNotFound(LookupError):
    """``previous_response_id`` names no stored response."""


class ItemNotFound(LookupError):
    """An ``item_reference`` names no stored item."""


def resolve_input(
    store: ResponseStore,
    items: Sequence[Mapping[str, Any]],
    previous_response_id: str | None,
) -> list[Mapping[str, Any]]:
    """The effective input: the previous response's input and output, then ``items`` resolved.

    Raises :class:`PreviousResponseNotFound` and :class:`ItemNotFound`.
    """
    resolved = [_resolve_item(store, item) for item in items]
    if previous_response_id is None:
        return resolved
    previous = store.get(previous_response_id)
    if previous is None:
        raise PreviousResponseNotFound(previous_response_id)
    return [*previous.effective_input, *previous.output, *resolved]


def _resolve_item(store: ResponseStore, item: Mapping[str, Any]) -> Mapping[str, Any]:
    kind = item.get("type")
    item_id = item.get("id")
    if kind == "item_reference":
        found = store.item(item_id) if isinstance(item_id, str) else None
        if found is None:
            raise ItemNotFound(str(item_id))
        return found
    if kind == "reasoning" and not item.get("encrypted_content") and isinstance(item_id, str):
        found = store.item(item_id)
        if found is not None and found.get("type") == "reasoning":
            return found
    return item
