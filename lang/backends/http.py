"""JSON over HTTP for the server backends, on aiohttp: every call is a coroutine, so a
program waiting on a server holds no thread (the synchronous API runs these on the background
loop, see background.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from radixlm.backends.backend import BackendError, current_program

PROGRAM_HEADER = "X-Program-Id"

# aiohttp sessions, one per event loop that made calls (a session belongs to its loop). Each
# is closed when its loop shuts down (asyncio.run cancels the task that holds it).
_sessions: dict[asyncio.AbstractEventLoop, Any] = {}
_keepers: set[asyncio.Task[None]] = set()


class HttpClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    async def get(self, path: str) -> Any:
        return await self._json("GET", path, None)

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        return await self._json("POST", path, body)

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Server-sent events: yield each `data:` payload until `data: [DONE]`. Stopping the
        iteration (or cancelling its task) closes the connection, which the server sees as
        the client going away."""
        async with self._request("POST", path, body) as response:
            await self._check(response, "POST", path)
            try:
                async for raw in response.content:
                    line = raw.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if isinstance(event, dict) and "error" in event:
                        raise BackendError(f"{path}: {_message(event)}")
                    yield event
            except BaseException:
                response.close()  # not read to the end: the connection cannot be reused
                raise

    async def _json(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        async with self._request(method, path, body) as response:
            await self._check(response, method, path)
            return json.loads(await response.read())

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        import aiohttp

        headers = {"Content-Type": "application/json"}
        program = current_program.get()
        if program is not None:  # radixlm's routes take it (others ignore the header)
            headers[PROGRAM_HEADER] = program
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode("utf-8")
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout,
                                        sock_read=self.timeout)
        return _Call(_session().request(method, self.base_url + path, data=data,
                                        headers=headers, timeout=timeout),
                     f"{method} {self.base_url}{path}")

    @staticmethod
    async def _check(response: Any, method: str, path: str) -> None:
        if response.status < 400:
            return
        raw = await response.read()
        try:
            detail = _message(json.loads(raw))
        except ValueError:
            detail = response.reason
        raise BackendError(f"{method} {path}: HTTP {response.status}: {detail}")


class _Call:
    """A request's context: a failure to connect becomes a BackendError naming the URL."""

    def __init__(self, request: Any, where: str) -> None:
        self.request = request
        self.where = where

    async def __aenter__(self) -> Any:
        import aiohttp

        try:
            return await self.request.__aenter__()
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise BackendError(f"{self.where}: {exc or type(exc).__name__}") from None

    async def __aexit__(self, *exc: Any) -> None:
        await self.request.__aexit__(*exc)


def _session() -> Any:
    import aiohttp

    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        for old in [old for old in _sessions if old.is_closed()]:
            del _sessions[old]
        session = _sessions[loop] = aiohttp.ClientSession()
        keeper = loop.create_task(_close_at_shutdown(loop, session))
        _keepers.add(keeper)
        keeper.add_done_callback(_keepers.discard)
    return session


async def _close_at_shutdown(loop: asyncio.AbstractEventLoop, session: Any) -> None:
    try:
        await asyncio.Event().wait()  # until the loop's shutdown cancels this task
    finally:
        if _sessions.get(loop) is session:
            del _sessions[loop]
        await session.close()


def _message(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message", payload["error"]))
    return str(payload)
