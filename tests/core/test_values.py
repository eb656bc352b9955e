"""Value classes and records (proxy/core/values.py): a compiled one's hand-written constructor
takes and sets exactly its fields, in order, with their defaults; a compiled module holds no
class mypyc cannot make native.

Read from the sources (``ast``), so a constructor that drops, swaps or renames a field fails
here whether or not the package was compiled.
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


def _value_classes() -> list[tuple[str, ast.ClassDef]]:
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


VALUE_CLASSES = _value_classes()


def test_the_hot_values_are_written_as_compiled_value_classes() -> None:
    names = {f"{module}.{cls.name}" for module, cls in VALUE_CLASSES}
    for name in (
        "proxy.core.model.Node",
        "proxy.core.model.TurnWrite",
        "proxy.core.match.Match",
        "proxy.core.match.KnownPrefix",
        "proxy.core.plan.TurnPlan",
        "proxy.core.prefix.Recalled",
        "proxy.core.usage.Usage",
        "proxy.core.record.Reply",
        "proxy.wire.base.Outgoing",
        "proxy.core.model.SessionTotals",
        "proxy.report.Answer",
    ):
        assert name in names


def _is_value(cls: ast.ClassDef) -> bool:
    """``unsafe_hash=True``: an immutable value; else a mutable record (its defaults declared)."""
    return any(
        isinstance(d, ast.Call) and any(k.arg == "unsafe_hash" and ast.literal_eval(k.value) for k in d.keywords)
        for d in cls.decorator_list
    )


@pytest.mark.parametrize(("module", "cls"), VALUE_CLASSES, ids=lambda v: getattr(v, "name", v))
def test_a_compiled_constructor_takes_and_sets_its_fields_in_order(module: str, cls: ast.ClassDef) -> None:
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
    init = inits[0]
    params = [a.arg for a in init.args.args[1:]]
    assert params == fields, f"{cls.name}.__init__ takes {params}, its fields are {fields}"
    assert not init.args.kwonlyargs and init.args.vararg is None and init.args.kwarg is None
    if defaults:
        given = dict(zip(params[len(params) - len(init.args.defaults) :], map(ast.unparse, init.args.defaults), strict=True))
        assert given == defaults, f"{cls.name}.__init__'s defaults are not its fields' defaults"
    assigned = [ast.unparse(s) for s in init.body if not isinstance(s, ast.Expr)]
    assert assigned == [f"self.{f} = {f}" for f in fields], f"{cls.name}.__init__ must only assign its fields, in order"

    # And the class the package imports is the dataclass those fields describe.
    imported = getattr(importlib.import_module(module), cls.name)
    assert [f.name for f in dataclasses.fields(imported)] == fields
    assert imported.__dataclass_params__.init is False
    assert imported.__dataclass_params__.unsafe_hash == _is_value(cls)


NATIVE_DECORATORS = {"dataclass", "mypyc_attr", "trait", "final"}
"""The class decorators mypyc keeps a native class under (``mypyc/irbuild/util.py``); any
other (:func:`~proxy.core.values.value` included) leaves an ordinary Python class, whose
fields compiled code reads by attribute lookup."""


@pytest.mark.parametrize("module", native.COMPILED)
def test_a_compiled_module_declares_no_class_mypyc_cannot_make_native(module: str) -> None:
    tree = ast.parse(native.source(module).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            other = {_decorator_name(d) for d in node.decorator_list} - NATIVE_DECORATORS
            assert not other, f"{module}.{node.name}: decorated {other}, mypyc makes it an interpreted class"


def test_a_copy_made_by_the_constructor_keeps_every_field() -> None:
    """``with_tokens`` and ``with_view`` rebuild a value positionally (``dataclasses.replace`` costs
    more than the request's planning): a field added and not passed on would be lost."""
    from proxy.core.model import Node
    from proxy.core.plan import TurnPlan
    from proxy.core.repair import NO_REPAIR
    from proxy.wire.responses import ItemsView

    node = Node(b"k" * 16, b"p" * 16, b"t" * 16, 3, "user", b"i" * 16, b"{}", -1, True, True, 12.5)
    assert node.with_tokens(7) == dataclasses.replace(node, tokens=7)
    view = ItemsView([{"role": "user", "content": "x"}], [(0,)], 0)
    plan = TurnPlan(b"r" * 16, None, NO_REPAIR, None, {"messages": []}, 4, b"spliced", "refused", 2, True, None)
    assert plan.with_view(view) == dataclasses.replace(plan, view=view)
    assert all(getattr(plan.with_view(view), f.name) is getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "view")


PLAIN_SUBCLASSES_OF_COMPILED = {"proxy.store.sqlite.SqliteStore"}
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
