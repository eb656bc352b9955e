"""A headless Chromium driven over the DevTools protocol with aiohttp's websocket client.

No selenium, no playwright: Debian's ``chromium`` runs with ``--remote-debugging-port=0``,
the port is read from ``DevToolsActivePort`` in its user-data-dir, and one page target is
driven with plain CDP commands (``Page.navigate``, ``Runtime.evaluate``, ...). Everything
the page reports as an error -- an uncaught exception, ``console.error``, a browser log
entry of level error (failed loads, CSP violations) -- is collected in :attr:`Page.errors`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any

import aiohttp
import pytest

BINARIES = ("chromium", "chromium-browser")
START_TIMEOUT = 20.0
COMMAND_TIMEOUT = 15.0


def chromium_binary() -> str:
    """The Chromium on PATH, or a skip that says how to install it."""
    for name in BINARIES:
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("chromium not installed: run .ci/install/chromium.sh")


class CDPError(RuntimeError):
    pass


class Page:
    """One page target: send commands, wait for events, collect errors."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._waiters: list[tuple[str, asyncio.Future[dict[str, Any]]]] = []
        self.errors: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = msg.json()
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    if "error" in data:
                        future.set_exception(CDPError(str(data["error"])))
                    else:
                        future.set_result(data.get("result", {}))
                continue
            method, params = data.get("method", ""), data.get("params", {})
            self._note(method, params)
            for waiter in [w for w in self._waiters if w[0] == method]:
                self._waiters.remove(waiter)
                if not waiter[1].done():
                    waiter[1].set_result(params)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(CDPError("the browser closed the connection"))

    def _note(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text", "")
            self.errors.append(f"exception: {text}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.errors.append(f"console.{params['type']}: {args}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip())

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        await self.ws.send_json({"id": ident, "method": method, "params": params})
        return await asyncio.wait_for(future, COMMAND_TIMEOUT)

    def expect(self, event: str) -> asyncio.Future[dict[str, Any]]:
        """A future for the next ``event`` (create it before the command that causes it)."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters.append((event, future))
        return future

    async def navigate(self, url: str) -> None:
        loaded = self.expect("Page.loadEventFired")
        result = await self.send("Page.navigate", url=url)
        if result.get("errorText"):
            raise CDPError(f"navigating to {url}: {result['errorText']}")
        await asyncio.wait_for(loaded, COMMAND_TIMEOUT)

    async def evaluate(self, expression: str, *, await_promise: bool = False) -> Any:
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=await_promise
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise CDPError(details.get("exception", {}).get("description") or details.get("text"))
        return result.get("result", {}).get("value")

    async def viewport(self, width: int, height: int, *, mobile: bool = False, scale: float = 1.0) -> None:
        await self.send(
            "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=scale, mobile=mobile
        )

    async def color_scheme(self, scheme: str) -> None:
        await self.send("Emulation.setEmulatedMedia", features=[{"name": "prefers-color-scheme", "value": scheme}])

    async def screenshot(
        self, path: Path, width: int, *, mobile: bool = False, scale: float = 1.0, max_height: int = 100_000
    ) -> None:
        """A PNG of the page at ``width`` CSS pixels: all of it, or its top ``max_height`` pixels."""
        await self.viewport(width, 800, mobile=mobile, scale=scale)
        height = min(max_height, await self.evaluate("Math.ceil(document.documentElement.scrollHeight)"))
        await self.viewport(width, int(height), mobile=mobile, scale=scale)
        clip = {"x": 0, "y": 0, "width": width, "height": int(height), "scale": 1}
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True, clip=clip)
        _write(path, base64.b64decode(shot["data"]))

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self.ws.close()


class Chromium:
    """A headless Chromium process on a temporary profile, and an HTTP session to its DevTools."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int, session: aiohttp.ClientSession) -> None:
        self.proc = proc
        self.port = port
        self.session = session
        self.pages: list[Page] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(cls, profile: Path) -> AsyncIterator[Chromium]:
        binary = chromium_binary()
        log = _prepare(profile)
        proc = await asyncio.create_subprocess_exec(
            binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage", "--hide-scrollbars", "--font-render-hinting=none",
            f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank",
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()  # the child holds its own descriptor
        session = aiohttp.ClientSession()
        try:
            port = await cls._port(profile, proc)
            browser = cls(proc, port, session)
            yield browser
            for page in browser.pages:
                await page.close()
        finally:
            await session.close()
            await _stop(proc)

    @staticmethod
    async def _port(profile: Path, proc: asyncio.subprocess.Process) -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT
        while loop.time() < deadline:
            if proc.returncode is not None:
                raise CDPError(f"chromium exited with {proc.returncode}: see {profile / 'chromium.log'}")
            port = _read_port(profile)
            if port is not None:
                return port
            await asyncio.sleep(0.05)
        raise CDPError(f"chromium wrote no DevToolsActivePort within {START_TIMEOUT:.0f} s")

    async def page(self) -> Page:
        """A new page target with Page, Runtime and Log enabled."""
        async with self.session.put(f"http://127.0.0.1:{self.port}/json/new?about:blank") as r:
            target = await r.json()
        ws = await self.session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        page = Page(ws)
        self.pages.append(page)
        for domain in ("Page", "Runtime", "Log"):
            await page.send(f"{domain}.enable")
        return page


def _prepare(profile: Path) -> IO[bytes]:
    """Create the profile directory, forget a previous run's port, open Chromium's log."""
    profile.mkdir(parents=True, exist_ok=True)
    (profile / "DevToolsActivePort").unlink(missing_ok=True)
    return (profile / "chromium.log").open("wb")


def _read_port(profile: Path) -> int | None:
    """The port Chromium wrote to ``DevToolsActivePort`` (first line), once it has."""
    try:
        return int((profile / "DevToolsActivePort").read_text().splitlines()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """End Chromium and its helper processes: its own process group, started by us."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
