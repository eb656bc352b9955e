"""``python -m proxy.build``: compile the request path with mypyc, in place (``make compile``).

Builds :data:`~proxy.native.COMPILED` into extension modules beside their sources and one
shared library (``proxy/_native__mypyc*.so``); the C sources and objects go to ``build/``.
Then writes :data:`~proxy.native.MANIFEST`, the fingerprint of the sources compiled: until it
matches the sources again, the package imports them as plain Python (:mod:`proxy.native`).
``--if-stale`` compiles only when the sources changed since the last build (or nothing was
built); ``--clean`` removes the extension modules and the manifest. Needs mypy (the ``dev`` extra)
and a C compiler with Python's headers.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path

from .native import COMPILED, MANIFEST, PACKAGE, fingerprint, source, stale

BUILD = PACKAGE.parent / "build"
GROUP = "proxy._native"
"""The shared library's module: ``proxy/_native__mypyc*.so``, inside the package."""


def clean() -> int:
    """Remove every extension module in the package and the manifest; the count removed."""
    MANIFEST.unlink(missing_ok=True)
    removed = 0
    for built in PACKAGE.rglob("*.so"):
        built.unlink()
        removed += 1
    return removed


def compile_native() -> None:
    """Compile :data:`COMPILED` in place; raises with the compiler's output when it fails."""
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.is_file():
        raise RuntimeError(f"Python's C headers are missing ({header}): install python3-dev")
    try:
        from mypyc.build import mypycify
        from setuptools import setup  # type: ignore[import-untyped]
    except ImportError as exc:
        raise RuntimeError(f"{exc.name} is needed to compile: pip install -e '.[dev]'") from exc
    expected = fingerprint()
    clean()
    root = PACKAGE.parent
    output = io.StringIO()
    cwd = os.getcwd()
    os.chdir(root)
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            extensions = mypycify(
                [str(source(module).relative_to(root)) for module in COMPILED],
                opt_level="3",
                debug_level="0",
                group_name=GROUP,
                target_dir=str(BUILD / "mypyc"),
            )
            setup(
                name="kvwarm-native",
                ext_modules=extensions,
                script_args=["build_ext", "--inplace", "--build-temp", str(BUILD / "temp")],
            )
    except (Exception, SystemExit) as exc:
        clean()
        raise RuntimeError(f"mypyc failed ({exc}):\n{output.getvalue()[-4000:]}") from None
    finally:
        os.chdir(cwd)
    MANIFEST.write_text(expected + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy.build", description=__doc__.splitlines()[0])
    parser.add_argument("--clean", action="store_true", help="remove the compiled modules instead")
    parser.add_argument("--if-stale", action="store_true", help="only when the sources changed since the last build")
    args = parser.parse_args(argv)
    if args.clean:
        print(f"kvwarm: removed {clean()} compiled modules; the request path runs as plain Python")
        return 0
    if args.if_stale and stale() is None:
        return 0
    started = time.monotonic()
    try:
        compile_native()
    except RuntimeError as exc:
        print(f"kvwarm: not compiled, the request path runs as plain Python: {exc}", file=sys.stderr)
        return 1
    print(f"kvwarm: compiled {len(COMPILED)} modules with mypyc in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
