"""Immutable value classes that are cheap to build and to read.

A ``@dataclass(frozen=True)`` sets each field through ``object.__setattr__`` in its
constructor, about three times the cost of a plain slotted class; the request path builds a
dozen such values per request (its nodes, match, plan, usage, reply) and reads their fields
many times more. Two forms keep them cheap:

- In a module compiled with mypyc (``proxy/native.py``), a value class is a native class:
  ``@dataclass(init=False, unsafe_hash=True)``, every field ``Final``, and an ``__init__`` that
  assigns the fields in order::

      @dataclass(init=False, unsafe_hash=True)  # a value class (proxy/core/values.py)
      class Span:
          start: Final[int]
          end: Final[int]

          def __init__(self, start: int, end: int = 0) -> None:
              self.start = start
              self.end = end

  mypyc compiles that constructor (about 30 ns against 165 ns for a generated one), and
  compiled code reads its fields from the object's struct instead of through attribute
  lookup. ``Final`` keeps it frozen to the type checker; the dataclass gives it ``__eq__``,
  ``__hash__``, ``__repr__``, ``fields`` and ``replace``. A class decorated with anything
  else (:func:`value` included) is not native to mypyc. ``tests/core/test_values.py`` checks
  that each such constructor takes and sets exactly its fields, in order.
  A mutable record read on the request path (:class:`~proxy.core.model.SessionTotals`) is
  written the same way without ``unsafe_hash`` and ``Final``, each field with its default.
- Elsewhere, :func:`value`: a slotted dataclass that the type checker treats as frozen (an
  assignment to a field is a type error) and that hashes and compares by its fields like a
  frozen one, built at the plain class's cost.

Nothing assigns to a value's fields: ``dataclasses.replace`` makes a new one.
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
