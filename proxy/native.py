"""The request path's hot modules compiled with mypyc, or the same modules as plain Python.

``make compile`` (``python -m proxy.build``) compiles the modules of :data:`COMPILED` with
mypyc into extension modules beside their sources (``proxy/core/match.cpython-311-*.so``...),
one shared library for them all (``proxy/_native__mypyc*.so``), and writes the fingerprint of
the sources it compiled to :data:`MANIFEST`. The code is the same: mypyc compiles the typed
Python as it is written, and checks its annotations at run time. A module is listed only where
a measurement shows that compiling it pays (docs/ARCHITECTURE.md, "The compiled request path");
every other module is plain Python.

Python imports an extension module before a source of the same name, so a source edited
after the build would be shadowed by its old compiled form. :func:`activate` (run when the
package is imported) makes that impossible: when the sources are not those compiled, when
nothing was compiled, or when ``KVWARM_PURE=1``, every ``proxy`` module is imported from its
source. Compiled modules call each other natively, so it is all of them or none.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["COMPILED", "MANIFEST", "activate", "fingerprint", "native_label", "stale", "state"]

PACKAGE = Path(__file__).resolve().parent
MANIFEST = PACKAGE / "_native.sha256"
"""The fingerprint of the sources the extension modules were compiled from (not in git)."""
PURE_ENV = "KVWARM_PURE"
"""``KVWARM_PURE=1``: import every module from its source, compiled or not."""

COMPILED: tuple[str, ...] = (
    # Run for every chunk or event of a stream.
    "proxy.core.sse",
    "proxy.core.usage",
    "proxy.core.record",
    "proxy.transport.http1",
    "proxy.wire.chat",
    "proxy.wire.responses",
    # Run for every message of every request, and on every repair.
    "proxy.core.identity",
    "proxy.core.match",
    "proxy.core.prefix",
    "proxy.core.plan",
    "proxy.core.breaks",
    "proxy.core.repair",
    "proxy.core.splice",
    # Value classes and stores that the modules above build and read natively.
    "proxy.core.model",
    "proxy.wire.base",
    "proxy.store.memory.store",
    "proxy.store.memory.index",
    "proxy.store.memory.sessions",
    "proxy.store.memory.costs",
    # Per request bookkeeping over the values above.
    "proxy.metrics.batch",
    "proxy.metrics.families",
    "proxy.metrics.observe",
    "proxy.core.pricing",
)
"""The modules whose compilation pays: built without any one of them (the rest compiled), a
measured load runs clearly more instructions per request (docs/ARCHITECTURE.md). The stream
kernels and the planning path save the most; the value classes (``Node``, ``Outgoing``...)
and the memory store stay because compiled callers build them and read their fields natively
(plain, each such read is an attribute lookup by name); metrics and pricing run over those
values on every request. The policy, the report, ``LocalStore``, tenancy, traits and the
fail-open guard saved too little to pay for the rules of a compiled module and stay plain, as
do the relay, the transport, the upstream and the pipeline: compiled coroutines crashed the
interpreter when a traceback through them, or a failed callback holding one, was formatted
(CPython 3.11.7), and tests patch the pipeline's methods."""

_state = "pure: not compiled (make compile)"


def source(module: str) -> Path:
    """The source file of a ``proxy`` module."""
    return PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")


def extension(module: str) -> Path:
    """Where the compiled form of a ``proxy`` module is (whether or not it was built)."""
    return source(module).with_suffix(importlib.machinery.EXTENSION_SUFFIXES[0])


def fingerprint(modules: Sequence[str] = COMPILED) -> str:
    """What a build of ``modules`` is valid for: their names and their sources' bytes, and
    the interpreter's version (an extension module is built for one)."""
    digest = hashlib.sha256(f"{sys.implementation.cache_tag}\n".encode())
    for module in modules:
        digest.update(f"{module}\n".encode())
        digest.update(hashlib.sha256(source(module).read_bytes()).digest())
    return digest.hexdigest()


def native_label() -> str:
    """``compiled`` or ``pure``: the ``native`` label of ``kvwarm_build_info``."""
    return "compiled" if _state == "compiled" else "pure"


def state() -> str:
    """How this process runs the request path: ``compiled``, or ``pure: <why>``."""
    return _state


class _FromSource(importlib.abc.MetaPathFinder):
    """Finds every ``proxy`` module at its source, never at an extension module beside it."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("proxy.") or not path:
            return None
        name = fullname.rpartition(".")[2]
        for folder in path:
            package = Path(folder) / name / "__init__.py"
            if package.is_file():
                return importlib.util.spec_from_file_location(fullname, package, submodule_search_locations=[str(package.parent)])
            module = Path(folder) / f"{name}.py"
            if module.is_file():
                return importlib.util.spec_from_file_location(fullname, module)
        return None


def stale() -> str | None:
    """Why the compiled modules cannot be used (not built, sources changed, a module missing);
    None when they can."""
    built = MANIFEST.read_text().strip() if MANIFEST.is_file() else ""
    if not built:
        return "not compiled (make compile)"
    if built != fingerprint():
        return "the sources changed since they were compiled (make compile)"
    if not all(extension(module).is_file() for module in COMPILED):
        return "an extension module is missing (make compile)"
    return None


def activate() -> str:
    """Decide, once per process, whether the compiled modules are imported (see the module's
    docstring); returns :func:`state`."""
    global _state
    if any(isinstance(finder, _FromSource) for finder in sys.meta_path):
        return _state
    why = f"{PURE_ENV}=1" if os.environ.get(PURE_ENV, "") not in ("", "0") else stale()
    if why is None:
        _state = "compiled"
    else:
        _state = f"pure: {why}"
        sys.meta_path.insert(0, _FromSource())
    return _state
