"""The compiled request path (proxy/native.py, proxy/build.py): used only when it was built
from the very sources beside it, and answering exactly as the plain Python does."""

from __future__ import annotations

import asyncio
import importlib.machinery
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

import proxy
from proxy import build, native
from proxy.sim.server import SimConfig, create_sim_app
from tests.agents import Agent, args_keys_reordered, tool_results_reordered, tools_reordered
from tests.conftest import received
from tests.test_serve import free_port, wait_ready

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def environ(**env: str) -> dict[str, str]:
    """This process's environment without ``KVWARM_PURE``, plus ``env``."""
    return {**{k: v for k, v in os.environ.items() if k != native.PURE_ENV}, **env}


def pure_on_purpose() -> bool:
    """``KVWARM_PURE=1``: this run is plain Python because it was asked to be."""
    return os.environ.get(native.PURE_ENV, "") not in ("", "0")


def skip_unless_this_machine_compiles() -> None:
    """Skip, with the reason, on a machine that cannot compile (no C compiler or no Python
    headers: :func:`proxy.build.unavailable`), where kvwarm runs as plain Python by design. On a
    machine that can, a missing or stale build is not skipped: the test then fails."""
    if native.stale() is None:
        return
    why = build.unavailable()
    if why is not None:
        pytest.skip(f"plain Python on this machine: {why}")


def test_the_suite_runs_the_request_path_compiled() -> None:
    """`make test` compiles first where a C compiler is: the suite tests what `make run` serves.
    (KVWARM_PURE=1 runs it as plain Python on purpose; a machine without a compiler, by need.)"""
    if pure_on_purpose():
        assert native.state() == f"pure: {native.PURE_ENV}=1"
        return
    skip_unless_this_machine_compiles()
    assert native.state() == "compiled", f"{native.state()}: run `make compile` (or `make test`)"
    import proxy.core.match
    import proxy.store.memory.store

    for module in (proxy.core.match, proxy.store.memory.store):
        assert module.__file__ is not None and module.__file__.endswith(SUFFIX)


def package_copy(tmp_path: Path, *, built: bool) -> Path:
    """The package's sources in ``tmp_path``; with ``built``, a manifest of them and an
    extension module beside each compiled one that cannot be loaded (garbage bytes): importing
    one means the sources were passed over."""
    shutil.copytree(Path(proxy.__file__).parent, tmp_path / "proxy", ignore=shutil.ignore_patterns("*.so", "__pycache__", "_native.sha256"))
    if built:
        copy = tmp_path / "proxy"
        for module in native.COMPILED:
            copy.joinpath(*module.split(".")[1:]).with_suffix(SUFFIX).write_bytes(b"not an extension module")
        (copy / native.MANIFEST.name).write_text(native.fingerprint() + "\n")
    return tmp_path


def imported(root: Path, **env: str) -> tuple[str, str]:
    """``proxy.native.state()`` and where ``proxy.core.match`` came from, in a fresh interpreter on ``root``."""
    code = "import proxy, proxy.core.match as m, proxy.store.memory.store; print(proxy.native.state()); print(m.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=environ(PYTHONPATH=str(root), **env),
        capture_output=True, text=True, timeout=60,
    )
    if done.returncode != 0:
        return "failed", done.stderr.strip().splitlines()[-1]
    state, file = done.stdout.strip().splitlines()
    return state, file


def test_a_build_of_the_same_sources_is_what_gets_imported(tmp_path: Path) -> None:
    """The control: with the manifest matching, the extension modules are imported (here they
    are garbage, so the import fails): the tests below pass over them for their reason only."""
    root = package_copy(tmp_path, built=True)
    state, error = imported(root)
    assert state == "failed" and "ImportError" in error


def test_an_edited_source_is_imported_from_source(tmp_path: Path) -> None:
    root = package_copy(tmp_path, built=True)
    with (root / "proxy" / "core" / "match.py").open("a") as f:
        f.write("\n# edited after the build\n")
    state, file = imported(root)
    assert state == "pure: the sources changed since they were compiled (make compile)"
    assert file == str(root / "proxy" / "core" / "match.py")


def test_an_edit_to_any_compiled_module_passes_over_all_of_them(tmp_path: Path) -> None:
    """Compiled modules call each other natively: one stale module means none is used."""
    root = package_copy(tmp_path, built=True)
    with (root / "proxy" / "store" / "memory" / "sessions.py").open("a") as f:
        f.write("\n")
    state, file = imported(root)
    assert state.startswith("pure: the sources changed") and file.endswith("match.py")


@pytest.mark.parametrize(
    ("built", "env", "why"),
    [
        (True, {native.PURE_ENV: "1"}, f"{native.PURE_ENV}=1"),
        (False, {}, "not compiled (make compile)"),
    ],
)
def test_plain_python_when_asked_or_not_built(tmp_path: Path, built: bool, env: dict[str, str], why: str) -> None:
    root = package_copy(tmp_path, built=built)
    state, file = imported(root, **env)
    assert (state, file) == (f"pure: {why}", str(root / "proxy" / "core" / "match.py"))


def test_a_missing_extension_module_means_plain_python(tmp_path: Path) -> None:
    root = package_copy(tmp_path, built=True)
    (root / "proxy" / "core" / f"plan{SUFFIX}").unlink()
    assert imported(root)[0] == "pure: an extension module is missing (make compile)"


TRACEBACK = """
import logging, traceback
import proxy
from proxy.core.identity import IdentityMemo
from proxy.core.match import match_request
from proxy.core.policy import Policy
from proxy.request.failopen import FailOpen

class Exploding:  # a store view whose every read fails
    def __getattr__(self, name):
        raise RuntimeError("store exploded")

logging.basicConfig(level=logging.ERROR)
body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
try:
    match_request(body, b"r" * 16, Exploding(), Policy(), IdentityMemo(), None)
except RuntimeError as exc:
    print("".join(traceback.format_exception(exc)))
    FailOpen().fail("match", exc)  # the guard's log line, with the traceback
print(proxy.native.state())
"""


def test_a_traceback_through_compiled_code_is_formatted(tmp_path: Path) -> None:
    """A fail-open error raised under compiled frames is logged with its traceback: formatting
    it must not crash the interpreter (a compiled coroutine's did, on 3.11.7: proxy/native.py)."""
    done = subprocess.run([sys.executable, "-c", TRACEBACK], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "store exploded" in done.stdout and "match_request" in done.stdout
    assert "match failed; going on without it (fail open)" in done.stderr and "store exploded" in done.stderr
    assert done.stdout.strip().endswith(native.state())


@pytest.mark.timeout(300)  # two interpreters run 1 200 requests each, each bounded at 120 s
@pytest.mark.parametrize("seed", [7, 2026])
def test_odd_conversations_fare_alike_compiled_and_as_plain_python(seed: int) -> None:
    """1 200 requests of odd and drifted conversations (tests/native_fuzz.py) through the stages:
    the same forwarded bytes, matches, repairs, breaks, replies, usage, nodes and fail-open
    stages, compiled and as plain Python (mypyc's run-time annotation checks must not turn a
    client's odd value into an error only the compiled build has)."""
    runs = []
    for env in ({}, {native.PURE_ENV: "1"}):
        done = subprocess.run(
            [sys.executable, "-m", "tests.native_fuzz", str(seed), "400"], env=environ(**env),
            capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(done.stdout.splitlines())
    (compiled_state, *compiled), (pure_state, *pure) = runs
    why = native.stale()
    assert (compiled_state, pure_state) == ("compiled" if why is None else f"pure: {why}", f"pure: {native.PURE_ENV}=1")
    assert len(compiled) == 1200 and compiled == pure
    assert sum('"whitespace"' in line or '"arguments"' in line for line in pure) > 100, "drift was repaired"


def test_a_machine_without_a_c_compiler_is_told_apart_from_a_failing_build(tmp_path: Path) -> None:
    """``proxy.build.unavailable``: the compiler setuptools would run (``CC``, else Python's own)
    must be on ``PATH``; only then is a build expected, and its failure an error."""
    path = os.environ.get("PATH", "")
    for cc in ("/nonexistent", "", "gcc -pthread"):
        why = build.unavailable({"CC": cc, "PATH": str(tmp_path)})  # nothing on that PATH
        assert why is not None and why.startswith("no C compiler") and repr(cc) in why, why
    fake = tmp_path / "fakecc"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    expected = None if headers.is_file() else f"Python's C headers are missing ({headers}; install python3-dev)"
    assert build.unavailable({"CC": "fakecc -O2", "PATH": f"{tmp_path}:{path}"}) == expected
    assert build.c_compiler({}) == sysconfig.get_config_var("CC")  # unset: Python's own compiler


def test_the_build_step_of_make_test_goes_on_as_plain_python_without_a_compiler() -> None:
    """``make test`` runs ``python -m proxy.build --if-stale --or-pure`` first: without a C
    compiler it says why in one line and succeeds; a plain ``make compile`` still fails. Neither
    touches the build (it stops before cleaning anything)."""
    before = sorted(native.PACKAGE.rglob("*.so")), native.MANIFEST.is_file()
    env = environ(CC="/nonexistent")
    tolerated = subprocess.run([sys.executable, "-m", "proxy.build", "--or-pure"], env=env, capture_output=True, text=True, timeout=60)
    assert tolerated.returncode == 0, tolerated.stderr
    assert tolerated.stdout == "kvwarm: no C compiler (CC='/nonexistent' is not on this machine; install gcc, or set CC): the request path runs as plain Python, not compiled\n"
    refused = subprocess.run([sys.executable, "-m", "proxy.build"], env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "not compiled" in refused.stderr and "/nonexistent" in refused.stderr
    assert (sorted(native.PACKAGE.rglob("*.so")), native.MANIFEST.is_file()) == before


def test_the_fingerprint_covers_sources_names_and_interpreter() -> None:
    base = native.fingerprint()
    assert native.fingerprint(native.COMPILED[:-1]) != base
    assert native.fingerprint(tuple(reversed(native.COMPILED))) != base
    assert native.fingerprint() == base


async def serve(sim: TestServer, **env: str) -> tuple[Any, str]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--port", str(port), "--upstream", str(sim.make_url("/v1")),
        "--store", "memory", env=environ(**env), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    await wait_ready(f"{base}/readyz", proc)
    return proc, base


@pytest.mark.parametrize("drift", [args_keys_reordered, tools_reordered, tool_results_reordered])
async def test_compiled_and_plain_python_answer_alike(aiohttp_server: Any, drift: Any) -> None:
    """The same drifting agent through a compiled kvwarm and a plain Python one: the same bytes
    upstream (repaired alike), the same prefix headers, and each says how it runs."""
    if pure_on_purpose() and native.stale() is not None:
        pytest.skip(f"{native.PURE_ENV}=1 and no current build to compare with")
    skip_unless_this_machine_compiles()
    results = []
    for env in ({}, {native.PURE_ENV: "1"}):
        sim = await aiohttp_server(create_sim_app(SimConfig()))
        proc, base = await serve(sim, **env)
        try:
            async with aiohttp.ClientSession() as session:

                async def post(body: dict[str, Any], session: aiohttp.ClientSession = session, base: str = base) -> dict[str, Any]:
                    async with session.post(f"{base}/v1/chat/completions", data=orjson.dumps(body), headers={"authorization": "Bearer sk-native"}) as r:
                        assert r.status == 200
                        answer: dict[str, Any] = await r.json()
                        answer["_headers"] = {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("x-kvwarm")}
                        return answer

                agent = Agent(post, drift=drift)
                await agent.run(5)
                async with session.get(f"{base}/metrics") as r:
                    exposition = await r.text()
        finally:
            proc.terminate()
            await proc.wait()
        build = next(line for line in exposition.splitlines() if line.startswith("kvwarm_build_info{"))
        results.append(([r.body for r in received(sim)], [t.response["_headers"] for t in agent.turns], build))
    (compiled_bodies, compiled_headers, compiled_build), (pure_bodies, pure_headers, pure_build) = results
    assert 'native="compiled"' in compiled_build and 'native="pure"' in pure_build
    assert compiled_bodies == pure_bodies
    assert compiled_headers == pure_headers
    repaired = [int(h["x-kvwarm-prefix"].split("repaired=")[1].split(";")[0]) for h in compiled_headers]
    assert sum(repaired) > 0, "the drift was repaired"
