"""``python -m proxy.build``: compile the request path with mypyc, in place (``make compile``).

Builds :data:`~proxy.native.COMPILED` into extension modules beside their sources and one
shared library (``proxy/_native__mypyc*.so``); the C sources and objects go to ``build/``.
Then writes :data:`~proxy.native.MANIFEST`, the fingerprint of the sources compiled: until it
matches the sources again, the package imports them as plain Python (:mod:`proxy.native`).
``--if-stale`` compiles only when the sources changed since the last build (or nothing was
built); ``--clean`` removes the extension modules and the manifest. Needs mypy (the ``dev`` extra)
and a C compiler with Python's headers.

A machine without a C compiler (or without Python's headers) cannot compile: kvwarm runs there as
plain Python, the same code. :func:`unavailable` tells that case apart from a build that fails;
``--or-pure`` (``make test``) says it in one line and succeeds, where a failing build with a
compiler present is still an error.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import shutil
import sys
import sysconfig
import time
from collections.abc import Mapping, Sequence
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


def c_compiler(environ: Mapping[str, str] | None = None) -> str:
    """The C compiler command a build runs: ``CC`` from the environment when it is set (even
    empty), else the one Python was built with, as setuptools chooses it."""
    env = os.environ if environ is None else environ
    if "CC" in env:
        return env["CC"]
    configured = sysconfig.get_config_var("CC")
    return configured if isinstance(configured, str) else "cc"


def unavailable(environ: Mapping[str, str] | None = None) -> str | None:
    """Why this machine cannot compile the request path: no C compiler (:func:`c_compiler` is
    not found on ``PATH``) or no Python headers. None when it can, and then a build that fails
    is an error to show, not a reason to run as plain Python."""
    env = os.environ if environ is None else environ
    command = c_compiler(env)
    try:
        words = shlex.split(command)
    except ValueError:  # unbalanced quotes: setuptools could not run it either
        words = []
    if not words or shutil.which(words[0], path=env.get("PATH")) is None:
        return f"no C compiler (CC={command!r} is not on this machine; install gcc, or set CC)"
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.is_file():
        return f"Python's C headers are missing ({header}; install python3-dev)"
    return None


def compile_native() -> None:
    """Compile :data:`COMPILED` in place; raises with the compiler's output when it fails."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(why)
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
    parser.add_argument(
        "--or-pure",
        action="store_true",
        help="on a machine that cannot compile (no C compiler or Python headers) say so and succeed: "
        "kvwarm then runs as plain Python. A build that fails with a compiler present still fails",
    )
    args = parser.parse_args(argv)
    if args.clean:
        print(f"kvwarm: removed {clean()} compiled modules; the request path runs as plain Python")
        return 0
    if args.if_stale and stale() is None:
        return 0
    why = unavailable()
    if why is not None and args.or_pure:
        print(f"kvwarm: {why}: the request path runs as plain Python, not compiled")
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
