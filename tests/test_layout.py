"""The package's shape, read from its sources (docs/ARCHITECTURE.md, "The map").

These hold the structure a contributor relies on: small classes and functions, a core with hard
edges, records built by keyword, and a top level that shows the design. Each check reads the
sources with ``ast``, so it holds whether or not the package was compiled.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy import native

MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 60
MAX_TOP_LEVEL_MODULES = 12


def _modules() -> Iterator[tuple[str, Path, ast.Module]]:
    for source in sorted(native.PACKAGE.rglob("*.py")):
        parts = source.relative_to(native.PACKAGE).with_suffix("").parts
        name = ".".join(("proxy", *parts[: -1 if parts[-1] == "__init__" else None]))
        yield name, source, ast.parse(source.read_text(encoding="utf-8"))


MODULES = list(_modules())


def _where(source: Path, node: ast.AST) -> str:
    return f"{source.relative_to(native.PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"


def test_no_class_or_function_is_too_long_to_read() -> None:
    long = []
    for _, source, tree in MODULES:
        for node in ast.walk(tree):
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    long.append(f"{_where(source, node)} {node.name}: {lines} lines (at most {limit})")
    assert not long, "\n".join(long)


def test_the_top_level_holds_a_dozen_modules_at_most() -> None:
    top = sorted(p.name for p in native.PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def _resolved(module: str, source: Path, node: ast.ImportFrom) -> str:
    """The absolute name an import names."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if source.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports(module: str, source: Path, tree: ast.Module) -> Iterator[tuple[str, ast.ImportFrom | ast.Import]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node
        elif isinstance(node, ast.ImportFrom):
            yield _resolved(module, source, node), node


def _imported_by(layer: str, outside: str) -> list[str]:
    """Each import, by a module of ``layer``, of a name under the top-level package ``outside``
    but not under ``layer``."""
    return [
        f"{_where(source, node)} imports {name}"
        for module, source, tree in MODULES
        if module.startswith(layer)
        for name, node in _imports(module, source, tree)
        if name.split(".")[0] == outside and not name.startswith(layer)
    ]


def test_the_core_imports_nothing_of_the_rest_of_the_package() -> None:
    leaks = _imported_by("proxy.core", "proxy")
    assert not leaks, "\n".join(leaks)


@pytest.mark.parametrize("layer", ["proxy.core", "proxy.wire", "proxy.store"])
def test_the_pure_layers_do_not_import_aiohttp(layer: str) -> None:
    leaks = _imported_by(layer, "aiohttp")
    assert not leaks, "\n".join(leaks)


def test_no_module_imports_another_modules_private_names() -> None:
    private = [
        f"{_where(source, node)} takes {alias.name} from {name}"
        for module, source, tree in MODULES
        for name, node in _imports(module, source, tree)
        if isinstance(node, ast.ImportFrom) and name.startswith("proxy")
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not private, "\n".join(private)


def _dataclass_keywords(cls: ast.ClassDef) -> dict[str, object] | None:
    for decorator in cls.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target) in {"dataclass", "dataclasses.dataclass"}:
            if not isinstance(decorator, ast.Call):
                return {}
            return {k.arg or "": ast.literal_eval(k.value) for k in decorator.keywords}
    return None


def test_every_record_is_built_by_keyword() -> None:
    """A dataclass is ``kw_only``, or writes its own keyword-only constructor (``init=False``,
    proxy/core/values.py; tests/core/test_values.py checks those constructors)."""
    positional = []
    for _, source, tree in MODULES:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                keywords = _dataclass_keywords(node)
                if keywords is not None and keywords.get("kw_only") is not True and keywords.get("init") is not False:
                    positional.append(f"{_where(source, node)} {node.name}")
    assert not positional, "\n".join(positional)
