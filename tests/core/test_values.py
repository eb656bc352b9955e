"""Value classes and records (proxy/core/values.py): a hand-written constructor takes each field
by keyword and sets it, a copy made by one keeps every field, and a compiled module holds no
class mypyc cannot make native.

Read from the sources (``ast``), so a constructor that drops or renames a field fails here
whether or not the package was compiled. (mypy does not see a ``Final`` field left unset.)
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util

import pytest

from proxy import native


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    return ast.unparse(target)


def _hand_written() -> list[tuple[str, ast.ClassDef]]:
    """Every ``@dataclass(init=False, ...)`` class of the package, by module: its constructor is
    written by hand (for mypyc to compile it)."""
    found = []
    for source in sorted(native.PACKAGE.rglob("*.py")):
        module = "proxy." + ".".join(source.relative_to(native.PACKAGE).with_suffix("").parts)
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            for dec in node.decorator_list:
                if (
                    isinstance(dec, ast.Call)
                    and _decorator_name(dec) == "dataclass"
                    and any(k.arg == "init" and ast.literal_eval(k.value) is False for k in dec.keywords)
                ):
                    found.append((module, node))
    return found


HAND_WRITTEN = _hand_written()


def test_the_values_built_per_request_have_compiled_constructors() -> None:
    """A generated ``__init__`` runs as Python even in a compiled module (proxy/core/values.py)."""
    names = {f"{module}.{cls.name}" for module, cls in HAND_WRITTEN}
    for name in (
        "proxy.core.model.Node",
        "proxy.core.model.SessionTotals",
        "proxy.core.model.TurnWrite",
        "proxy.core.match.Match",
        "proxy.core.match.KnownPrefix",
        "proxy.core.plan.TurnPlan",
        "proxy.core.prefix.Recalled",
        "proxy.core.record.Reply",
        "proxy.core.breaks.Break",
        "proxy.core.sse.SSEEvent",
        "proxy.core.usage.Usage",
        "proxy.core.pricing.Cost",
    ):
        assert name in names


def _is_value(cls: ast.ClassDef) -> bool:
    """``unsafe_hash=True``: an immutable value; else a mutable record (its defaults declared)."""
    return any(
        isinstance(d, ast.Call) and any(k.arg == "unsafe_hash" and ast.literal_eval(k.value) for k in d.keywords)
        for d in cls.decorator_list
    )


@pytest.mark.parametrize(("module", "cls"), HAND_WRITTEN, ids=lambda v: getattr(v, "name", v))
def test_a_hand_written_constructor_takes_each_field_by_keyword_and_sets_it(module: str, cls: ast.ClassDef) -> None:
    fields, defaults = [], {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            name = stmt.target.id
            if _is_value(cls):
                assert stmt.value is None, f"{cls.name}.{name}: a value's default goes in __init__'s signature"
                assert ast.unparse(stmt.annotation).startswith("Final["), f"{cls.name}.{name} is not Final"
            else:
                assert stmt.value is not None, f"{cls.name}.{name}: a record declares its default"
                defaults[name] = ast.unparse(stmt.value)
            fields.append(name)
    inits = [s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"]
    assert len(inits) == 1, f"{cls.name} has no __init__ of its own"
    args = inits[0].args
    assert len(args.args) == 1 and args.vararg is None and args.kwarg is None, f"{cls.name}.__init__ is not keyword-only"
    params = [a.arg for a in args.kwonlyargs]
    assert params == fields, f"{cls.name}.__init__ takes {params}, its fields are {fields}"
    if defaults:
        given = {p: ast.unparse(d) for p, d in zip(params, args.kw_defaults, strict=True) if d is not None}
        assert given == defaults, f"{cls.name}.__init__'s defaults are not its fields' defaults"
    assigned = [ast.unparse(s) for s in inits[0].body if not isinstance(s, ast.Expr)]
    assert assigned == [f"self.{f} = {f}" for f in fields], f"{cls.name}.__init__ must only assign its fields, in order"

    # And the class the package imports is the dataclass those fields describe.
    imported = getattr(importlib.import_module(module), cls.name)
    assert [f.name for f in dataclasses.fields(imported)] == fields
    assert imported.__dataclass_params__.init is False
    assert imported.__dataclass_params__.unsafe_hash == _is_value(cls)


NATIVE_DECORATORS = {"dataclass", "mypyc_attr", "trait", "final"}
"""The class decorators mypyc keeps a native class under (``mypyc/irbuild/util.py``); any other
leaves an ordinary Python class, whose fields compiled code reads by attribute lookup."""


@pytest.mark.parametrize("module", native.COMPILED)
def test_a_compiled_module_declares_no_class_mypyc_cannot_make_native(module: str) -> None:
    tree = ast.parse(native.source(module).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            other = {_decorator_name(d) for d in node.decorator_list} - NATIVE_DECORATORS
            assert not other, f"{module}.{node.name}: decorated {other}, mypyc makes it an interpreted class"


def test_a_copy_made_by_the_constructor_keeps_every_field() -> None:
    """``with_tokens``, ``with_view`` and the memory store's ``copy_totals`` call the constructor
    (``dataclasses.replace`` costs some 50 times as much): a field added to the class and not
    passed on there would silently take its default."""
    from proxy.core.model import Node, SessionTotals
    from proxy.core.plan import TurnPlan
    from proxy.core.repair import NO_REPAIR
    from proxy.store.memory.sessions import copy_totals
    from proxy.wire.responses import ItemsView

    node = Node(
        key=b"k" * 16, parent=b"p" * 16, tenant=b"t" * 16, depth=3, role="user", identity=b"i" * 16, body=b"{}",
        tokens=-1, generated=True, partial=True, created=12.5,
    )
    assert node.with_tokens(7) == dataclasses.replace(node, tokens=7)
    view = ItemsView(messages=[{"role": "user", "content": "x"}], spans=[(0,)], reused=0)
    plan = TurnPlan(
        root=b"r" * 16, match=None, repair=NO_REPAIR, brk=None, forwarded={"messages": []}, messages=4,
        spliced=b"spliced", refused="refused", clean=2, tools_clean=True,
    )
    assert plan.with_view(view) == dataclasses.replace(plan, view=view)
    assert all(getattr(plan.with_view(view), f.name) is getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "view")
    totals = SessionTotals(
        turns=1, prompt_tokens=2, cached_tokens=3, completion_tokens=4, unknown_cache_turns=5, cost_usd=6.5,
        billed=True, repaired=7, last_break="content_changed", model="m", created=8.5, updated=9.5,
    )
    assert all(getattr(totals, f.name) != f.default for f in dataclasses.fields(totals))
    copied = copy_totals(totals)
    assert copied == totals and copied is not totals


PLAIN_SUBCLASSES_OF_COMPILED = {"proxy.store.sqlite.store.SqliteStore"}
"""Plain Python classes of the package that subclass a compiled one. Compiled code calls every
method of such an instance through mypyc's glue, a lookup by name: a class the request path
uses on every request must not be one (a plain ``Response(Body)`` cost a Codex request 8 k
instructions). ``SqliteStore`` pays it on its few calls per request (docs/ARCHITECTURE.md)."""


def _classes_by_module() -> dict[str, dict[str, ast.ClassDef]]:
    found: dict[str, dict[str, ast.ClassDef]] = {}
    for source in sorted(native.PACKAGE.rglob("*.py")):
        module = "proxy." + ".".join(source.relative_to(native.PACKAGE).with_suffix("").parts)
        tree = ast.parse(source.read_text(encoding="utf-8"))
        found[module] = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    return found


def test_no_plain_class_of_the_package_subclasses_a_compiled_one_unless_listed() -> None:
    """Resolved through the imports, not by name alone: a compiled module's class imported into
    a plain module and subclassed there counts; a plain class of the same name does not."""
    classes = _classes_by_module()
    compiled = set(native.COMPILED)
    offenders = set()
    for module, by_name in classes.items():
        if module in compiled:
            continue
        tree = ast.parse(native.source(module).read_text(encoding="utf-8"))
        imported: dict[str, str] = {}  # local name -> the module it was imported from
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                base_module = importlib.util.resolve_name("." * node.level + node.module, module.rpartition(".")[0]) if node.level else node.module
                for alias in node.names:
                    imported[alias.asname or alias.name] = base_module
        for name, cls in by_name.items():
            for base in cls.bases:
                base_name = ast.unparse(base).split("[")[0]
                origin = imported.get(base_name)
                if origin in compiled and base_name in classes.get(origin, {}):
                    offenders.add(f"{module}.{name}")
    assert offenders == PLAIN_SUBCLASSES_OF_COMPILED
