"""JSON over HTTP for the server backends, on the standard library (no client dependency):
a program that talks to a server needs nothing but radixlm."""

from __future__ import annotations

import contextlib
import json
import socket
import urllib.error
import urllib.request
from typing import Any, Iterator

from radixlm.backends.backend import BackendError


class HttpClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def get(self, path: str) -> Any:
        with self._open("GET", path, None) as response:
            return json.load(response)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        with self._open("POST", path, body) as response:
            return json.load(response)

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Server-sent events: yield each `data:` payload until `data: [DONE]`."""
        with self._open("POST", path, body) as response:
            yield from self.events(response, path)

    def open_stream(self, path: str, body: dict[str, Any]) -> Any:
        """POST and return the open response, for `events`; `hang_up` ends it."""
        return self._open("POST", path, body)

    @staticmethod
    def hang_up(response: Any) -> None:
        """Close a response from another thread: the socket is shut down first, so that a
        read blocked on it returns now (and the server sees the client go)."""
        sock = getattr(getattr(getattr(response, "fp", None), "raw", None), "_sock", None)
        with contextlib.suppress(OSError):
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(Exception):
            response.close()

    @staticmethod
    def events(response: Any, path: str) -> Iterator[dict[str, Any]]:
        """A response's server-sent events (see `stream`)."""
        for raw in response:
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

    def _open(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers,
                                         method=method)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            try:
                detail = _message(json.loads(exc.read()))
            except ValueError:
                detail = exc.reason
            raise BackendError(f"{method} {path}: HTTP {exc.code}: {detail}") from None
        except urllib.error.URLError as exc:
            raise BackendError(f"{method} {self.base_url}{path}: {exc.reason}") from None


def _message(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message", payload["error"]))
    return str(payload)
