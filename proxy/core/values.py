"""Immutable value classes that are cheap to build: :func:`value`.

A ``@dataclass(frozen=True)`` sets each field through ``object.__setattr__`` in its
constructor, about three times the cost of a plain slotted class; the request path builds a
dozen such values per request (its nodes, match, plan, usage, reply). :func:`value` makes a
slotted dataclass that the type checker treats as frozen (an assignment to a field is a type
error) and that hashes and compares by its fields like a frozen one, built at the plain
class's cost. Nothing assigns to a value's fields: ``dataclasses.replace`` makes a new one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import TypeVar, dataclass_transform

__all__ = ["value"]

_T = TypeVar("_T")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def value(cls: type[_T]) -> type[_T]:
    """``@dataclass(frozen=True, slots=True)`` to the type checker; a slotted dataclass with the
    same ``__eq__`` and ``__hash__`` at run time."""
    return dataclasses.dataclass(slots=True, unsafe_hash=True)(cls)
