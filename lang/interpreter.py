"""Executes one program state: its expressions, in order, as a task of an event loop (the
background loop for `run`, the caller's own for `arun`).

`s += expr` only queues the expression, so the program's Python code runs ahead until it reads
a value (`s["name"]`, or `await s.aget("name")` in an async program), which waits for it.
That is what lets a fork's branches, and the programs of a batch, reach the engine at the same
time and share one batch.

A failure (a bad request, a backend error) stops the state: the rest of its queue is dropped,
and every read of a variable it did not produce raises `ProgramError` with the cause. Nothing
waits forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from radixlm import segments
from radixlm.backends import speculation
from radixlm.backends.backend import Backend, Prompt, current_program, using_adapter
from radixlm.chat import RoleRenderer
from radixlm.expr import (
    Concat,
    Expr,
    Gen,
    Role,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    Text,
    ToolCalls,
    VarScopeBegin,
    VarScopeEnd,
)
from radixlm.runtime.protocol import reasoning
from radixlm.waiting import BlockingWaitOnLoop, Condition

log = logging.getLogger(__name__)


class ProgramError(RuntimeError):
    """A program failed; `__cause__` is the original error."""


@dataclass
class Chunk:
    """A piece of text appended to a state, for streaming: `var` names the gen it came from,
    `meta` is that gen's meta info for this piece (token counts so far, the new logprobs)."""

    text: str
    var: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Interpreter:
    def __init__(self, backend: Backend, defaults: dict[str, Any],
                 loop: asyncio.AbstractEventLoop, stream: bool = False,
                 parent: "Interpreter | None" = None, spec_tokens: int | None = None) -> None:
        self.backend = backend
        self.defaults = defaults  # run()'s sampling defaults, under every gen's own fields
        self.loop = loop  # where the state's expressions execute, as one task at a time
        self.stream = stream
        self.renderer = RoleRenderer(self._render)
        # Guards what the program's side and the executing task share; the program's side
        # may be another thread (run) or a coroutine on the same loop (arun).
        self._cv = Condition()
        self._queue: deque[Expr] = deque()
        # Expressions at the front of the queue released for execution. A backend that runs
        # segments waits for a flush (a read, a fork, the program's end) so that everything
        # queued by then forms segments; any other starts each expression at once.
        self._ready = 0
        # num_api_spec_tokens: segments whose gens share calls, on a backend that can.
        self.spec_tokens = spec_tokens if backend.supports_speculation else None
        self._lazy = backend.supports_segments or self.spec_tokens is not None
        self.flush_group: Callable[[], None] | None = None  # flushes the run's every state
        self._busy = False  # a task is draining the queue
        self.program_id: str | None = None  # the run's: every backend call carries it
        self._task: asyncio.Task[None] | None = None
        # Variables that queued expressions will (re)write: a read waits for the newest value.
        self._pending: dict[str, int] = {}
        self.error: BaseException | None = None
        self.closed = False  # the program finished: no more chunks will come
        self.chunks: list[Chunk] = []
        if parent is None:
            self.text = ""
            self.vars: dict[str, Any] = {}
            self.meta: dict[str, Any] = {}
            self.messages: list[dict[str, str]] = []
            self.role: str | None = None
            self.role_start = 0
            self.role_opening = self.role_closing = ""
            # The open role's other message fields, and its whole message once a tool call
            # wrote it (the text then holds the template's rendering of the calls).
            self.role_fields: dict[str, Any] = {}
            self.role_message: dict[str, Any] | None = None
            self.scopes: dict[str, int] = {}
        else:  # a fork: a copy of the parent's (synced) state
            self.text = parent.text
            self.vars = dict(parent.vars)
            self.meta = dict(parent.meta)
            self.messages = [dict(m) for m in parent.messages]
            self.role, self.role_start = parent.role, parent.role_start
            self.role_opening, self.role_closing = parent.role_opening, parent.role_closing
            self.role_fields = dict(parent.role_fields)
            self.role_message = parent.role_message
            self.scopes = dict(parent.scopes)
        self.fork_point = len(self.text)
        self.new_vars: list[str] = []  # set since the fork, in order (join's gather)

    # -- the program's side ------------------------------------------------------------------

    def submit(self, expr: Expr) -> None:
        with self._cv:
            if self.error is not None:
                return  # a failed state ignores the rest of the program
            for leaf in _flatten(expr):
                self._queue.append(leaf)
                name = _produces(leaf)
                if name is not None:
                    self._pending[name] = self._pending.get(name, 0) + 1
            if not self._lazy:
                self._release()

    def flush(self) -> None:
        """Release everything queued so far for execution."""
        with self._cv:
            self._release()

    def _release(self) -> None:  # with self._cv held
        self._ready = len(self._queue)
        if self._ready and not self._busy and self.error is None:
            self._busy = True
            try:
                self.loop.call_soon_threadsafe(self._start)
            except RuntimeError:  # the loop is closed (an arun's loop that ended)
                self._busy = False
                self._fail_locked(ProgramError(
                    "the event loop this program ran on is closed; nothing more can run"))

    def _start(self) -> None:
        self._task = self.loop.create_task(self._drain())

    def _flush_all(self) -> None:
        # A read in one branch starts the others' queued work too, so that forks still run
        # side by side when the program reads them one after another.
        if self.flush_group is not None:
            self.flush_group()
        else:
            self.flush()

    def _idle(self) -> bool:
        return not self._busy

    def sync(self) -> None:
        """Wait until everything submitted so far has run (or the state failed)."""
        self._flush_all()
        self._wait(self._idle, "the program's end")

    async def wait_idle(self) -> None:
        """`sync` for coroutines: waits without blocking the loop."""
        self._flush_all()
        await self._cv.wait_async(self._idle)

    def _has(self, name: str) -> Callable[[], bool]:
        return lambda: (self.error is not None or not self._busy
                        or (name in self.vars and not self._pending.get(name)))

    def get(self, name: str) -> Any:
        self._flush_all()
        self._wait(self._has(name), f"s[{name!r}]")
        return self._value(name)

    async def aget(self, name: str) -> Any:
        self._flush_all()
        await self._cv.wait_async(self._has(name))
        return self._value(name)

    def _value(self, name: str) -> Any:
        with self._cv:
            if name in self.vars:
                return self.vars[name]
            if self.error is not None:
                raise ProgramError(f"variable {name!r} was not produced: the program failed: "
                                   f"{self.error}") from self.error
            known = ", ".join(sorted(self.vars)) or "none"
            raise KeyError(f"no variable {name!r} in this state (variables: {known})")

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Block this thread until `ready()`. On the state's own event loop that would stop
        the very task it waits for: an async program awaits instead."""
        try:
            self._cv.wait(ready, self.loop)
        except BlockingWaitOnLoop:
            raise ProgramError(
                f"{what} waits for the model, which would block the event loop the program "
                f"runs on; in an async program await it (await s.aget(name), await s.wait(), "
                f"await s.afork(n), await s.ajoin(forks)), or use run()") from None

    def set_var(self, name: str, value: Any) -> None:
        with self._cv:
            self.vars[name] = value
            self.new_vars.append(name)
            self._cv.notify()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            self._fail_locked(error)

    def _fail_locked(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._queue.clear()
        self._ready = 0
        self._pending.clear()
        self._cv.notify()

    def cancel(self, error: BaseException) -> None:
        """Fail the state and stop what it is executing (its backend call is abandoned)."""
        self.fail(error)
        task = self._task
        if task is not None and not task.done():
            self.loop.call_soon_threadsafe(task.cancel)

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify()

    def _chunks_from(self, start: int) -> Callable[[], bool]:
        return lambda: len(self.chunks) > start or self.closed

    def wait_chunks(self, start: int) -> tuple[list[Chunk], bool]:
        """Chunks from index `start` on, waiting for at least one unless the state is done."""
        self._wait(self._chunks_from(start), "text_iter")
        return self._chunks_since(start)

    async def await_chunks(self, start: int) -> tuple[list[Chunk], bool]:
        await self._cv.wait_async(self._chunks_from(start))
        return self._chunks_since(start)

    def _chunks_since(self, start: int) -> tuple[list[Chunk], bool]:
        with self._cv:
            return self.chunks[start:], self.closed and len(self.chunks) <= start

    # -- the executing task ------------------------------------------------------------------

    async def _drain(self) -> None:
        current_program.set(self.program_id)  # this task's context (and its children's)
        try:
            while True:
                with self._cv:
                    if not self._ready or not self._queue:
                        self._busy = False
                        self._cv.notify()
                        return
                    count = min(self._ready, len(self._queue))
                    batch = [self._queue.popleft() for _ in range(count)]
                    self._ready = 0
                await self._run_batch(batch)
        except BaseException as exc:  # cancelled (the run was): nothing more runs
            with self._cv:
                self._busy = False
                self._fail_locked(exc if self.error is None else self.error)
            raise

    async def _run_batch(self, batch: list[Expr]) -> None:
        done = 0
        while done < len(batch) and self.error is None:
            message = self._speculable_message(batch, done)
            if message:
                await self._speculate_message(batch[done:done + message])
                done += message
                continue
            planned = await segments.plan(self, batch[done:]) if self._segments() else None
            stream = None if planned is None else self._start_segment(
                planned[1], batch[done:done + planned[0]])
            if planned is None or stream is None:
                await self._run_one(batch[done])
                done += 1
                continue
            count, segment, renders = planned
            real = self.backend
            replay = segments.Replay(real, segment, stream, renders)
            self.backend = replay
            try:
                for expr in batch[done:done + count]:
                    if self.error is None:
                        await self._run_one(expr)
            finally:
                self.backend = real
                replay.close()
            done += count

    def _speculable_message(self, batch: list[Expr], start: int) -> int:
        """With num_api_spec_tokens on a chat backend: the length of the assistant message at
        `start` (opening to closing) when it mixes text and gens, which one chat call then
        writes; else 0."""
        if self.spec_tokens is None or not isinstance(batch[start], RoleBegin) \
                or batch[start].role != "assistant" or self.role is not None:
            return 0
        for end in range(start + 1, len(batch)):
            if isinstance(batch[end], RoleEnd):
                inner = batch[start + 1:end]
                gens = [e for e in inner if isinstance(e, Gen)]
                plain = all(isinstance(e, (Text, Gen)) for e in inner)
                if plain and gens and len(inner) > 1 and all(
                        speculation.speculable(g.params(self.defaults)) for g in gens) \
                        and len({g.adapter(self.defaults) for g in gens}) == 1:
                    return end - start + 1
                return 0
        return 0

    async def _speculate_message(self, exprs: list[Expr]) -> None:
        parts = [e.text if isinstance(e, Text) else e.params(self.defaults)
                 for e in exprs[1:-1] if isinstance(e, (Text, Gen))]
        adapter = next(e for e in exprs if isinstance(e, Gen)).adapter(self.defaults)
        try:
            with using_adapter(adapter):
                answers = await speculation.speculate_message(self.backend, self.messages,
                                                              parts, self.spec_tokens or 0)
        except Exception as exc:  # noqa: BLE001 - fails this state, as a call would
            self.fail(exc)
            return
        real = self.backend
        self.backend = speculation.Answers(real, answers)
        try:
            for expr in exprs:
                if self.error is None:
                    await self._run_one(expr)
        finally:
            self.backend = real

    def _segments(self) -> bool:
        """Whether what follows may run as a segment."""
        # Speculation continues text: a program in roles makes chat calls, one per gen.
        return self.backend.supports_segments or (
            self.spec_tokens is not None and not self.messages and self.role is None)

    def _start_segment(self, segment: segments.Segment,
                       exprs: list[Expr]) -> segments.SegmentStream | None:
        # The plan keeps one adapter per segment: its steps' (the stream's task inherits it).
        with using_adapter(segments.adapter_of(self, exprs)):
            if self.backend.supports_segments:
                return self.backend.start_segment(segment)
            if any(isinstance(e, (RoleBegin, RoleEnd)) for e in exprs):
                return None
            return self.backend.speculate(segment, self.spec_tokens or 0)

    async def _run_one(self, expr: Expr) -> None:
        try:
            await self._execute(expr)
        except Exception as exc:  # noqa: BLE001 - any failure ends this state only
            log.debug("program step %s failed: %s", type(expr).__name__, exc)
            self.fail(exc)
        name = _produces(expr)
        with self._cv:
            if name is not None and self._pending.get(name):
                self._pending[name] -= 1
                self._cv.notify()

    async def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._append(expr.text)
        elif isinstance(expr, Gen):
            await self._gen(expr)
        elif isinstance(expr, Select):
            await self._select(expr)
        elif isinstance(expr, ToolCalls):
            await self._tool_calls(expr)
        elif isinstance(expr, SeparateReasoning):
            self._separate_reasoning(expr)
        elif isinstance(expr, RoleBegin):
            await self._role_begin(expr.role, dict(expr.fields))
        elif isinstance(expr, RoleEnd):
            await self._role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self.scopes[expr.name] = len(self.text)
        elif isinstance(expr, VarScopeEnd):
            self.set_var(expr.name, self.text[self.scopes.pop(expr.name):])
        else:  # pragma: no cover - _flatten only yields the kinds above
            raise TypeError(f"unknown expression {expr!r}")

    def _append(self, text: str, var: str | None = None,
                meta: dict[str, Any] | None = None) -> None:
        if not text:
            return
        with self._cv:
            self.text += text
            self.chunks.append(Chunk(text, var, meta or {}))
            self._cv.notify()

    async def _gen(self, expr: Gen) -> None:
        params = expr.params(self.defaults)
        prompt = Prompt(self.text, self._open_messages(), self.role)
        streamed: list[str] = []

        def on_delta(delta: str, meta: dict[str, Any]) -> None:
            streamed.append(delta)
            self._append(delta, expr.name, meta)

        # A number's text is only known once its end is (see expr.NUMBER_END): not streamed.
        number = expr.dtype in (int, float)
        with using_adapter(expr.adapter(self.defaults)):
            result = await self.backend.agenerate(
                prompt, params, on_delta if self.stream and not number else None)
        text = result.text.rstrip(" \n") if number else result.text
        done = "".join(streamed)
        if not text.startswith(done):  # never expected; keep the text exact anyway
            raise RuntimeError("streamed text does not match the final text")
        self._append(text[len(done):], expr.name, result.meta)
        if expr.name is not None:
            self.meta[expr.name] = result.meta
            self.set_var(expr.name, _convert(text, expr.dtype, expr.name) if expr.convert
                         else text)

    async def _select(self, expr: Select) -> None:
        # Score "The answer is" + " yes", not "The answer is " + "yes": BPE vocabularies
        # attach a space to the word after it, and a choice scored after a dangling space
        # is an unnatural tokenization the model gives little probability to.
        stem = self.text.rstrip(" ")
        space = self.text[len(stem):]
        with using_adapter(expr.adapter(self.defaults)):
            scores = await self.backend.ascore(stem, [space + c for c in expr.choices],
                                               expr.method.needs_unconditional)
        result = expr.method(scores)
        choice = expr.choices[result.index]
        self._append(choice, expr.name)
        if expr.name is not None:
            self.meta[expr.name] = {"scores": result.scores, "method": expr.method.name,
                                    "token_logprobs": scores.conditional,
                                    "unconditional_token_logprobs": scores.unconditional}
            self.set_var(expr.name, choice)

    async def _tool_calls(self, expr: ToolCalls) -> None:
        if self.role != "assistant" or self.text[self.role_start:] or self.role_message:
            raise ValueError("tool_call must be the whole content of an assistant message: "
                             "s += rl.assistant(rl.tool_call(...))")
        prompt = Prompt(self.text, self._open_messages(), self.role)
        with using_adapter(expr.adapter(self.defaults)):
            result = await self.backend.acall_tools(prompt, expr.tools,
                                                    expr.params(self.defaults))
        calls = result.meta.get("tool_calls") or []
        if not calls:  # the model answered with text
            self._append(result.text, expr.name, result.meta)
        else:
            message = {"role": "assistant", "content": result.text, "tool_calls": calls}
            body = await self.renderer.body(self.messages, message, self.role_opening,
                                      self.role_closing)
            if body is None:  # no template (or an odd one): one JSON call per line
                body = result.text + "".join(f"\n{json.dumps(c['function'])}" for c in calls)
            self._append(body, expr.name, result.meta)
            self.role_message = message
        if expr.name is not None:
            self.meta[expr.name] = result.meta
            self.set_var(expr.name, [{"id": c.get("id"), "name": c["function"]["name"],
                                      "arguments": c["function"]["arguments"]} for c in calls])

    def _separate_reasoning(self, expr: SeparateReasoning) -> None:
        reply = self.vars[expr.name]
        thought, answer = reasoning.split(expr.parser, reply)
        with self._cv:
            if self.text.endswith(reply):  # the gen's text is the last thing appended
                self.text = self.text[:len(self.text) - len(reply)] + answer
        self.set_var(f"{expr.name}_reasoning_content", thought)
        self.set_var(expr.name, answer)

    async def _role_begin(self, role: str, fields: dict[str, Any] | None = None) -> None:
        if self.role is not None:
            raise ValueError(f"roles cannot nest: {role!r} opened inside {self.role!r}")
        self.role_fields = fields or {}
        self.role_opening, self.role_closing = await self.renderer.delimiters(
            self.messages, role, self.role_fields)
        self._append(self.role_opening)
        self.role, self.role_start = role, len(self.text)
        self.role_message = None

    async def _role_end(self, role: str) -> None:
        if self.role != role:
            raise ValueError(f"role {role!r} closed but {self.role!r} is open")
        self.messages.append(self.role_message or {
            "role": role, "content": self.text[self.role_start:], **self.role_fields})
        self.role, self.role_message = None, None
        self._append(self.role_closing)

    def _open_messages(self) -> list[dict[str, Any]]:
        messages = [dict(m) for m in self.messages]
        if self.role is not None:
            messages.append(self.role_message or {
                "role": self.role, "content": self.text[self.role_start:], **self.role_fields})
        return messages

    async def _render(self, messages: list[dict[str, str]]) -> str | None:
        return await self.backend.arender_chat(messages, add_generation_prompt=False)


def _flatten(expr: Expr) -> list[Expr]:
    if isinstance(expr, Concat):
        return [leaf for part in expr.parts for leaf in _flatten(part)]
    if isinstance(expr, Role):
        return [RoleBegin(expr.role, expr.fields), *_flatten(expr.content), RoleEnd(expr.role)]
    return [expr]


def _produces(expr: Expr) -> str | None:
    """The variable an expression sets when it runs, if any."""
    if isinstance(expr, (Gen, Select, ToolCalls)):
        return expr.name
    if isinstance(expr, SeparateReasoning):
        return expr.name
    if isinstance(expr, VarScopeEnd):
        return expr.name
    return None


def _convert(text: str, dtype: type | None, name: str) -> Any:
    if dtype is None:
        return text
    try:
        if dtype is bool:
            if text.strip() not in ("True", "False"):
                raise ValueError(text)
            return text.strip() == "True"
        if dtype is str:
            return text.strip().removeprefix('"').removesuffix('"')
        return dtype(text.strip())
    except ValueError:
        raise ProgramError(f"gen {name!r}: {text!r} is not a valid {dtype.__name__}") from None
