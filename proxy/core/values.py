"""How the package writes its value classes (parsed values, plans, records): the two forms.

A value class is a frozen, keyword-only dataclass, each field written once; it is built with
keywords and copied with ``dataclasses.replace``::

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Repair:
        depth: int
        kind: str

    Repair(depth=1, kind="arguments")

A value built on every request, or for every event of a stream, is written with a constructor
of its own instead. mypyc keeps any dataclass a native class (compiled code reads its fields
from the object's struct), but it never compiles the ``__init__`` a dataclass generates: that
one runs as Python, called through ``*args, **kwargs``, and a frozen one sets each field
through ``object.__setattr__``: for six fields, 27 times the instructions of a compiled
constructor (``dataclasses.replace``, 36 times). So::

    @dataclass(init=False, unsafe_hash=True)  # built per request (proxy/core/values.py)
    class Break:
        reason: Final[str]
        depth: Final[int]
        span: Final[Span | None]

        def __init__(self, *, reason: str, depth: int, span: Span | None = None) -> None:
            self.reason = reason
            self.depth = depth
            self.span = span

``Final`` keeps the fields read-only to the type checker; the dataclass still gives ``__eq__``,
``__hash__``, ``__repr__``, ``fields`` and ``replace``. The constructor is keyword-only like the
other form's: mypyc resolves the keywords of a call from compiled code when it compiles it, at
no cost. A copy on the request path is a method that calls the constructor
(``Node.with_tokens``). A mutable record built per request (``SessionTotals``) is written the
same way without ``unsafe_hash`` and ``Final``, each field with its default.
``tests/core/test_values.py`` checks each such constructor against its fields.

Nothing assigns to a value's fields.
"""
