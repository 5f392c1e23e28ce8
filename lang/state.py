"""`s`, the state a program appends to and reads from, and the branches of a fork."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from concurrent.futures import Future
from typing import Any, AsyncIterator, Iterator, Sequence

from radixlm.backends import background
from radixlm.backends.backend import using_adapter
from radixlm.expr import (
    ADAPTER,
    Expr,
    Role,
    RoleBegin,
    RoleEnd,
    VarScopeBegin,
    VarScopeEnd,
    adapter_name,
    to_expr,
)
from radixlm.interpreter import Interpreter, ProgramError

log = logging.getLogger(__name__)

JOIN_MODES = {"gather_variable": "gather", "concate_and_append": "concat"}  # SGLang's names


class Run:
    """What one program run shares across its state and forks: the backend, the event loop its
    states execute on, the leases its forks took (released at join, and at the end of the run
    whatever happens), its states."""

    def __init__(self, backend: Any, defaults: dict[str, Any], stream: bool,
                 loop: asyncio.AbstractEventLoop, spec_tokens: int | None = None) -> None:
        self.backend = backend
        self.spec_tokens = spec_tokens  # the program's num_api_spec_tokens
        # Sent with every request the run makes (its forks' too): the runtime's per-program
        # statistics and scheduling know the calls belong together.
        self.program_id = uuid.uuid4().hex
        self.defaults = defaults
        self.stream = stream
        self.loop = loop
        self.interpreters: list[Interpreter] = []
        self.leases: list[Future] = []
        self.releases: list[Future] = []  # release calls not known to be done
        self._lock = threading.Lock()

    def interpreter(self, parent: Interpreter | None = None) -> Interpreter:
        interp = Interpreter(self.backend, self.defaults, self.loop, self.stream, parent,
                             self.spec_tokens)
        interp.flush_group = self.flush
        interp.program_id = self.program_id
        with self._lock:
            self.interpreters.append(interp)
        return interp

    def flush(self) -> None:
        """Release every state's queued expressions for execution."""
        with self._lock:
            interpreters = list(self.interpreters)
        for interp in interpreters:
            interp.flush()

    def pin(self, text: str) -> Future | None:
        """Ask the backend to pin `text`, without waiting: the branches go out at once, and the
        engine lets them wait for the prefix's prefill instead of computing it again."""
        if not self.backend.supports_cache_hints or not text:
            return None
        lease = asyncio.run_coroutine_threadsafe(self._pin(text), self.loop)
        with self._lock:
            self.leases.append(lease)
        return lease

    async def _pin(self, text: str) -> Any:
        try:
            with using_adapter(adapter_name(self.defaults.get(ADAPTER))):  # where branches look
                return await self.backend.apin_prefix(text)
        except Exception as exc:  # noqa: BLE001 - a failed pin only costs the hint
            log.warning("prefix pin failed: %s", exc)
            return None

    def release(self, lease: Future | None) -> None:
        """Release a fork's lease; waits for it, except on the run's own loop (where the end
        of the run waits)."""
        future = self._start_release(lease)
        if future is not None and background.running_loop() is not self.loop:
            future.result()

    async def arelease(self, lease: Future | None) -> None:
        future = self._start_release(lease)
        if future is not None:
            await asyncio.wrap_future(future)

    def _start_release(self, lease: Future | None) -> Future | None:
        with self._lock:
            if lease is None or lease not in self.leases:
                return None
            self.leases.remove(lease)
            future = asyncio.run_coroutine_threadsafe(self._release(lease), self.loop)
            self.releases.append(future)
            return future

    async def _release(self, lease: Future) -> None:
        handle = await asyncio.wrap_future(lease)
        if handle is not None:
            try:
                await self.backend.arelease_prefix(handle)
            except Exception as exc:  # noqa: BLE001 - the lease expires by itself
                log.warning("prefix release failed: %s", exc)

    def finish(self) -> None:
        """Wait for every state of the run, release what is still leased, end the streams."""
        if background.running_loop() is self.loop:
            raise RuntimeError("Run.finish on the run's own loop: await afinish()")
        asyncio.run_coroutine_threadsafe(self.afinish(), self.loop).result()

    async def afinish(self) -> None:
        for interp in list(self.interpreters):
            await interp.wait_idle()
        for lease in list(self.leases):
            await self.arelease(lease)
        for release in list(self.releases):
            await asyncio.wrap_future(release)
        try:  # what the runtime kept warm between the program's calls
            await self.backend.arelease_program(self.program_id)
        except Exception as exc:  # noqa: BLE001 - the pin expires by itself
            log.warning("releasing the program's pin failed: %s", exc)
        for interp in self.interpreters:
            interp.close()

    def cancel(self, error: BaseException) -> None:
        """Stop every state of the run (the caller was cancelled)."""
        for interp in list(self.interpreters):
            interp.cancel(error)
        for lease in list(self.leases):
            self._start_release(lease)
        for interp in self.interpreters:
            interp.close()


class ProgramState:
    """The `s` of a program. `s += expr` appends; `s["name"]` reads a variable, waiting for
    it; `s.text()`, `s.messages()` and `s.error()` describe the result."""

    def __init__(self, run: Run, interp: Interpreter) -> None:
        self._run = run
        self._interp = interp

    # -- appending ---------------------------------------------------------------------------

    def __iadd__(self, other: Any) -> "ProgramState":
        self._interp.submit(to_expr(other))
        return self

    @contextlib.contextmanager
    def _block(self, begin: Expr, end: Expr) -> Iterator[None]:
        self._interp.submit(begin)
        try:
            yield
        finally:
            self._interp.submit(end)

    def _role(self, role: str, content: Any) -> Any:
        if content is None:  # `with s.user():` wraps what the block appends
            return self._block(RoleBegin(role), RoleEnd(role))
        message = Role(role, to_expr(content))  # `s.user("Hi")` appends a whole message
        self._interp.submit(message)
        return message

    def system(self, content: Any = None) -> Any:
        return self._role("system", content)

    def user(self, content: Any = None) -> Any:
        return self._role("user", content)

    def assistant(self, content: Any = None) -> Any:
        return self._role("assistant", content)

    def var_scope(self, name: str) -> contextlib.AbstractContextManager[None]:
        """`with s.var_scope("x"):` stores the text appended inside the block in `x`."""
        return self._block(VarScopeBegin(name), VarScopeEnd(name))

    # -- branches ----------------------------------------------------------------------------

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> "ForkGroup":
        """`size` branches that continue from here. Their shared prefix is computed once and
        kept cached until `join` (or the end of the program)."""
        _check_fork(size, position_ids_offset)
        self._interp.sync()
        return self._fork_now(size)

    async def afork(self, size: int = 1, position_ids_offset: Any = None) -> "ForkGroup":
        """`fork` for async programs: waits for the state without blocking the loop."""
        _check_fork(size, position_ids_offset)
        await self._interp.wait_idle()
        return self._fork_now(size)

    def _fork_now(self, size: int) -> "ForkGroup":
        self._raise_if_failed()
        lease = self._run.pin(self._interp.text)
        branches = [ProgramState(self._run, self._run.interpreter(self._interp))
                    for _ in range(size)]
        return ForkGroup(branches, lease, self)

    @contextlib.contextmanager
    def copy(self) -> Iterator["ProgramState"]:
        """`with s.copy() as c:` a branch of its own, joined (its variables gathered) after."""
        forks = self.fork(1)
        try:
            yield forks[0]
        finally:
            self.join(forks)

    def join(self, forks: "ForkGroup", mode: str = "gather") -> dict[str, list[Any]] | None:
        """Wait for the branches. `gather` (SGLang: `gather_variable`) sets (and returns) each
        variable the branches produced as a list over the branches; `concat` (SGLang:
        `concate_and_append`) appends their new text to this state, in branch order."""
        mode = _join_mode(forks, mode)
        try:
            for branch in forks:
                branch._interp.sync()
            self._raise_if_branch_failed(forks)
        finally:
            self._run.release(forks.lease)
        return self._merge(forks, mode)

    async def ajoin(self, forks: "ForkGroup", mode: str = "gather"
                    ) -> dict[str, list[Any]] | None:
        """`join` for async programs: waits for the branches without blocking the loop."""
        mode = _join_mode(forks, mode)
        try:
            for branch in forks:
                await branch._interp.wait_idle()
            self._raise_if_branch_failed(forks)
        finally:
            await self._run.arelease(forks.lease)
        return self._merge(forks, mode)

    def _raise_if_branch_failed(self, forks: "ForkGroup") -> None:
        failed = [b._interp.error for b in forks if b._interp.error is not None]
        if failed:
            self._interp.fail(failed[0])
            raise ProgramError(f"a branch failed: {failed[0]}") from failed[0]

    def _merge(self, forks: "ForkGroup", mode: str) -> dict[str, list[Any]] | None:
        if mode == "concat":
            for branch in forks:
                self += branch._interp.text[branch._interp.fork_point:]
            return None
        names = list(dict.fromkeys(n for b in forks for n in b._interp.new_vars))
        gathered = {name: [b._interp.vars.get(name) for b in forks] for name in names}
        for name, values in gathered.items():
            self._interp.meta[name] = [b._interp.meta.get(name) for b in forks]
            self._interp.set_var(name, values)
        return gathered

    # -- reading -----------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Any:
        return self._interp.get(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self._interp.sync()
        return name in self._interp.vars

    def get_var(self, name: str) -> Any:
        return self._interp.get(name)

    async def aget(self, name: str) -> Any:
        """`s[name]` for async programs: waits for the variable without blocking the loop."""
        return await self._interp.aget(name)

    def set_var(self, name: str, value: Any) -> None:
        self._interp.sync()
        self._interp.set_var(name, value)

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """Token counts, finish reason and logprobs of gen `name`; scores of select `name`."""
        self._interp.get(name)
        return self._interp.meta[name]

    def text(self) -> str:
        self._interp.sync()
        return self._interp.text

    def messages(self) -> list[dict[str, str]]:
        """The conversation so far in OpenAI format (an open role included)."""
        self._interp.sync()
        return self._interp._open_messages()

    def error(self) -> BaseException | None:
        self._interp.sync()
        return self._interp.error

    def sync(self) -> None:
        self._interp.sync()

    async def wait(self) -> None:
        """`sync` for async code: wait until everything appended so far has run."""
        await self._interp.wait_idle()

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is appended (run with stream=True to get gen output token by
        token); with `var_name`, only what gen/select `var_name` produces."""
        seen = 0
        while True:
            chunks, done = self._interp.wait_chunks(seen)
            if done:
                return
            seen += len(chunks)
            for chunk in chunks:
                if var_name is None or chunk.var == var_name:
                    yield chunk.text

    async def text_async_iter(self, var_name: str | None = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        """`text_iter` for asyncio code (it waits without blocking the loop). With
        `return_meta_data`, yields (text, meta info) pairs: the gen's token counts so far and,
        with return_logprob, the logprobs of the tokens of this piece."""
        seen = 0
        while True:
            chunks, done = await self._interp.await_chunks(seen)
            if done:
                return
            seen += len(chunks)
            for chunk in chunks:
                if var_name is None or chunk.var == var_name:
                    yield (chunk.text, chunk.meta) if return_meta_data else chunk.text

    def _raise_if_failed(self) -> None:
        if self._interp.error is not None:
            raise ProgramError(f"the program failed: {self._interp.error}") \
                from self._interp.error

    @property
    def program_id(self) -> str:
        """The id every request of this run carries (the runtime's per-program statistics,
        the server's access log)."""
        return self._run.program_id

    def __repr__(self) -> str:
        return f"ProgramState(text={self._interp.text!r})"


class ForkGroup(Sequence[ProgramState]):
    """The branches of `s.fork(n)`. `forks += expr` appends to every branch, `forks[i] +=` to
    one; `forks += lambda i: ...` and `forks += [e0, e1, ...]` give each branch its own.
    `forks.join()` is `s.join(forks)`."""

    def __init__(self, branches: list[ProgramState], lease: Any,
                 parent: ProgramState) -> None:
        self._branches = branches
        self.lease = lease
        self.parent = parent

    def __getitem__(self, index):  # type: ignore[override]
        return self._branches[index]

    def __setitem__(self, index: int, value: ProgramState) -> None:
        # `forks[i] += x` assigns the result back; it must be the same branch.
        if value is not self._branches[index]:
            raise TypeError("cannot replace a branch of a fork")

    def __len__(self) -> int:
        return len(self._branches)

    def __iadd__(self, other: Any) -> "ForkGroup":
        if callable(other) and not isinstance(other, Expr):
            parts = [other(i) for i in range(len(self._branches))]
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self._branches):
                raise ValueError(f"forks += list: {len(other)} items for "
                                 f"{len(self._branches)} branches")
            parts = list(other)
        else:
            parts = [other] * len(self._branches)
        for branch, part in zip(self._branches, parts):
            branch += part
        return self

    def join(self, mode: str = "gather") -> dict[str, list[Any]] | None:
        return self.parent.join(self, mode)

    async def ajoin(self, mode: str = "gather") -> dict[str, list[Any]] | None:
        return await self.parent.ajoin(self, mode)


def _check_fork(size: Any, position_ids_offset: Any) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"fork: size must be a positive int, got {size!r}")
    if position_ids_offset is not None:
        raise ValueError("fork: position_ids_offset is not supported")


def _join_mode(forks: Any, mode: str) -> str:
    mode = JOIN_MODES.get(mode, mode)
    if mode not in ("gather", "concat"):
        raise ValueError(f"join: mode must be 'gather' or 'concat' (or SGLang's "
                         f"'gather_variable', 'concate_and_append'), got {mode!r}")
    if not isinstance(forks, ForkGroup):
        raise TypeError("join: pass the ForkGroup that fork() returned")
    return mode
