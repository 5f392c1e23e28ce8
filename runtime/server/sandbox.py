"""Chat templates rendered, and tool schemas checked, in killable worker processes: bounded in
time, memory and output size.

A chat template is a program (Jinja). The model's, the operator's (--chat-template) and, with
--trust-request-chat-template, a client's all run here, never in the HTTP process: a Jinja
loop cannot be interrupted in a thread, and one C-level operation (`'A' * 400000000`, a
`replace` that multiplies a string) grows memory faster than any count of loops or output
could stop it. A worker that runs past its time is killed and replaced; one that allocates
past its address-space limit gets a MemoryError; what it renders beyond `max_chars` is refused
before it is sent back. JSON Schema meta-validation of tool `parameters` (quadratic
`uniqueItems` on a large `enum`) runs here for the same reason.

The workers render with transformers' own `apply_chat_template(tokenize=False)` (its sandboxed
Jinja environment), so the text is the same as the tokenizer would write. They talk JSON over
their stdin/stdout, one request at a time; each has a thread of the HTTP process waiting on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import selectors
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger("radixlm.server")

WORKERS = 2
RENDER_TIMEOUT = 10.0  # seconds a render may take (ServerConfig.chat_template_timeout)
SCHEMA_TIMEOUT = 2.0  # seconds to check one request's tool schemas
MEMORY_BYTES = 1 << 30  # address space a worker may add to what its imports took
MAX_CHARS = 32 << 20  # rendered text, when the context gives no tighter bound
START_TIMEOUT = 120.0  # seconds a new worker may take to import transformers
_HEADER = struct.Struct(">I")


class SandboxError(Exception):
    """A render or check that failed; `kind`: syntax, template, timeout, too_large, memory,
    crashed or schema (then `where` names the tool field)."""

    def __init__(self, kind: str, message: str, where: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.where = where


class Sandbox:
    """A pool of worker processes. `call` is a coroutine and never blocks the event loop."""

    def __init__(self, template: Any, special_tokens: dict[str, Any],
                 max_chars: int | None = None, timeout: float = RENDER_TIMEOUT,
                 workers: int = WORKERS, memory_bytes: int = MEMORY_BYTES) -> None:
        self.template = template  # str, or a dict of named templates (tokenizer.chat_template)
        self.special_tokens = special_tokens
        self.max_chars = max_chars or MAX_CHARS
        self.timeout = timeout
        self._workers = [_Worker(memory_bytes) for _ in range(workers)]
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for w in self._workers:
            self._idle.put(w)
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")

    def warm(self) -> None:
        """Start the workers now (they import transformers), not on the first request."""
        for w in self._workers:
            w.spawn()

    async def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None, kwargs: dict[str, Any],
                     template: str | None = None) -> str:
        """The conversation as the template writes it; `template` overrides the model's."""
        chosen = self.template if template is None else template
        return await self._call({"op": "render", "template": chosen,
                                 "special": self.special_tokens, "messages": messages,
                                 "tools": tools, "add_generation_prompt": add_generation_prompt,
                                 "kwargs": kwargs, "max_chars": self.max_chars}, self.timeout)

    async def check_schemas(self, schemas: list[tuple[str, Any]]) -> None:
        """SandboxError(kind="schema", where=the field) for the first schema that is not a
        valid JSON Schema under its own (or the latest) draft's meta-schema."""
        if schemas:
            await self._call({"op": "check_schemas", "schemas": schemas}, SCHEMA_TIMEOUT)

    async def _call(self, request: dict[str, Any], timeout: float) -> Any:
        payload = json.dumps(request, ensure_ascii=False, default=str).encode(
            "utf-8", "surrogatepass")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self._call_blocking, payload, timeout)

    def _call_blocking(self, payload: bytes, timeout: float) -> Any:
        worker = self._idle.get()
        try:
            return worker.call(payload, timeout)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        for w in self._workers:
            w.close()


class _Worker:
    """One worker process; used by one thread at a time (the pool's idle queue sees to it),
    except `close`, which any thread may call: a closed worker starts no successor."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.closed = False

    def spawn(self) -> None:
        if self.closed:
            raise SandboxError("closed", "the renderer is shut down")
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixlm.runtime.server.sandbox", str(self.memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self.ready = False

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def close(self) -> None:
        """Kill the process for good (a call in flight on another thread then fails)."""
        self.closed = True
        proc = self.proc
        if proc is not None:
            proc.kill()  # a read in flight on another thread fails, which closes the pipes
            proc.wait()

    def restart(self) -> None:
        """Kill the worker and start its successor now: it imports while nobody waits."""
        self.kill()
        if not self.closed:
            self.spawn()

    def call(self, payload: bytes, timeout: float) -> Any:
        self.spawn()
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            if not self.ready:  # the import time does not count against the request
                self._read(proc, time.monotonic() + START_TIMEOUT, "start")
                self.ready = True
            proc.stdin.write(_HEADER.pack(len(payload)) + payload)
            proc.stdin.flush()
            reply = self._read(proc, time.monotonic() + timeout, "timeout")
        except SandboxError:
            self.restart()  # a worker past its time (or dead)
            raise
        except OSError:  # the pipe broke: the worker died (e.g. killed by the OOM killer)
            self.restart()
            raise SandboxError("crashed", "died while rendering") from None
        except BaseException:
            # Anything else leaves a reply unread in the pipe, which the next caller would
            # take for its own: never reuse this worker.
            self.restart()
            raise
        if "error" in reply:
            if reply["kind"] == "memory":
                self.restart()  # a fresh worker rather than one with a fragmented heap
            raise SandboxError(reply["kind"], reply["error"], reply.get("where"))
        return reply["ok"]

    @staticmethod
    def _read(proc: subprocess.Popen, deadline: float, late: str) -> Any:
        """A reply; SandboxError(`late`) past the deadline."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        # selectors, not select.select: that refuses descriptors past 1023, which a busy
        # server's restarted worker can get.
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            header = _Worker._read_exactly(fd, selector, _HEADER.size, deadline, late)
            data = _Worker._read_exactly(fd, selector, _HEADER.unpack(header)[0], deadline,
                                         late)
        return json.loads(data.decode("utf-8", "surrogatepass"))

    @staticmethod
    def _read_exactly(fd: int, selector: selectors.BaseSelector, size: int, deadline: float,
                      late: str) -> bytes:
        chunks: list[bytes] = []
        while size:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                raise SandboxError(late, "took too long")
            chunk = os.read(fd, min(size, 1 << 20))
            if not chunk:
                raise SandboxError("crashed", "died while rendering")
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)


# -- the operator's template, checked at start-up ---------------------------------------------

def read_template(source: str) -> str:
    """--chat-template's value: the Jinja text itself, or a file holding it (the rule
    models/loader.py's load_tokenizer applies)."""
    path = Path(source).expanduser()
    if "\n" not in source and "{" not in source:
        if not path.is_file():
            raise ValueError(f"--chat-template: no file {source!r} (pass a file or the "
                             f"template's Jinja text)")
        return path.read_text()
    return source


def check_template(template: Any, what: str = "--chat-template") -> None:
    """ValueError naming `what` and the line if the template (or one of a dict's named
    templates) is not valid Jinja. Compiling runs none of the template's code."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    texts = template.items() if isinstance(template, dict) else [(None, template)]
    for name, text in texts:
        try:
            _compile_jinja_template(text)
        except jinja2.TemplateSyntaxError as exc:
            label = what if name is None else f"{what} ({name!r})"
            raise ValueError(f"{label} is not a valid Jinja template: line {exc.lineno}: "
                             f"{exc.message}") from None


# -- the worker process -----------------------------------------------------------------------

def _worker_main(memory_bytes: int) -> None:
    import resource

    import jinja2
    import jsonschema
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    class Template:  # what apply_chat_template(tokenize=False) reads of a tokenizer
        get_chat_template = PreTrainedTokenizerBase.get_chat_template
        apply_chat_template = PreTrainedTokenizerBase.apply_chat_template

        def __init__(self, template: Any, special: dict[str, Any]) -> None:
            self.chat_template = template
            self.special_tokens_map = special

    def handle(request: dict[str, Any]) -> Any:
        if request["op"] == "check_schemas":
            for where, schema in request["schemas"]:
                try:
                    jsonschema.validators.validator_for(schema).check_schema(schema)
                except jsonschema.SchemaError as exc:
                    raise SandboxError("schema", f"{where} is not a valid JSON Schema: "
                                                 f"{exc.message}", where) from None
            return None
        template = Template(request["template"], request["special"])
        text = template.apply_chat_template(
            request["messages"], tools=request["tools"], tokenize=False,
            add_generation_prompt=request["add_generation_prompt"], **request["kwargs"])
        if len(text) > request["max_chars"]:
            raise SandboxError("too_large", f"the chat template wrote {len(text)} characters, "
                                            f"more than {request['max_chars']}")
        return text

    _exit_with_parent()
    with open("/proc/self/status") as f:  # what the imports took, plus the budget
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + memory_bytes, size + memory_bytes))
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the channel

    def send(reply: dict[str, Any]) -> None:
        data = json.dumps(reply, ensure_ascii=False).encode("utf-8", "surrogatepass")
        out.write(_HEADER.pack(len(data)) + data)
        out.flush()

    send({"ok": "ready"})
    while header := inp.read(_HEADER.size):
        data = inp.read(_HEADER.unpack(header)[0])
        request = json.loads(data.decode("utf-8", "surrogatepass"))
        try:
            reply: dict[str, Any] = {"ok": handle(request)}
        except SandboxError as exc:
            reply = {"error": exc.message, "kind": exc.kind, "where": exc.where}
        except MemoryError:
            reply = {"error": "ran out of memory", "kind": "memory"}
        except jinja2.TemplateSyntaxError as exc:
            reply = {"error": f"line {exc.lineno}: {exc.message}", "kind": "syntax"}
        except RecursionError:
            reply = {"error": "nests too deeply", "kind": "template"}
        except Exception as exc:  # raise_exception(), roles that do not alternate, ...
            reply = {"error": str(exc)[:2000], "kind": "template"}
        try:
            send(reply)
        except MemoryError:
            send({"error": "ran out of memory", "kind": "memory"})


def _exit_with_parent() -> None:
    """A render runs until its parent stops it; a parent that was killed cannot, so a thread
    ends this process once the parent is gone (its stdin is read only between requests)."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]))
