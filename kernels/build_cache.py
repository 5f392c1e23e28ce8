"""A build cache that a killed process cannot wedge: one folder per build key, built by one
process at a time under an OS file lock, in a temporary folder renamed into place when done.

- The lock is `flock` on `<root>/<name>-<key>.lock`, held on an open file: it dies with its
  holder, whatever kills it (SIGTERM, SIGKILL, the OOM killer). The holder writes its pid
  there, so a waiter can say whom it waits for (it does after `notice_after` seconds).
- The build runs in `<root>/.<name>-<key>.tmp-*` and becomes `<root>/<name>-<key>` by one
  rename after it succeeded: the folder is complete or absent, never half written. A later
  build under the lock discards the temporary folders that killed builds left.
- The build command runs in a session of its own under a watchdog (this file run as a
  script) that kills the whole session (ninja, the compilers it spawned) when the process
  that started it dies or gives up: an interrupt, an exception, a SIGKILL. A compiler that
  still outlives everything can only write into a temporary folder nobody uses.

Standard library only: the watchdog runs this file without importing the package.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


class BuildError(RuntimeError):
    """The build command failed; the message ends with the tail of its output."""


def cached_build(root: Path, name: str, key: str, prepare: Callable[[Path], list[str]],
                 what: str, notice_after: float = 5.0) -> Path:
    """`<root>/<name>-<key>`, built first when absent: `prepare(folder)` writes the build's
    inputs into an empty temporary folder and returns the command that builds there (run
    with that folder as its working directory). Raises BuildError when the command fails."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{name}-{key}"
    if final.is_dir():
        return final
    with _FileLock(root / f"{name}-{key}.lock", f"{what} in {final}", notice_after):
        if final.is_dir():  # built by the process we waited for
            return final
        for stale in root.glob(f".{name}-{key}.tmp-*"):  # left by killed builds: unused
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-{key}.tmp-{os.getpid()}-", dir=root))
        tmp.chmod(0o755)
        try:
            log.warning("building %s (first use, ~1 min) in %s", what, final)
            start = time.monotonic()
            run_in_session(prepare(tmp), tmp, tmp / "build.log")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("built %s in %.0f s", what, time.monotonic() - start)
        return final


class _FileLock:
    """An exclusive flock on `path`, waited for with a log line naming `what` and the holder."""

    def __init__(self, path: Path, what: str, notice_after: float):
        self.path, self.what, self.notice_after = path, what, notice_after
        self.fd = -1

    def __enter__(self) -> _FileLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        start = notice = time.monotonic()
        notice += self.notice_after
        try:  # whatever stops the wait (Ctrl-C in the sleep, too) closes the descriptor
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pass
                if time.monotonic() >= notice:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                    log.warning("waiting %.0f s so far for another process (pid %s) building "
                                "%s (lock %s)", time.monotonic() - start, holder, self.what,
                                self.path)
                    notice = time.monotonic() + 60
                time.sleep(0.1)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held.add(fd)
        return self

    def __exit__(self, *exc: object) -> None:
        _held.discard(self.fd)
        os.close(self.fd)  # releases the lock; the file stays (unlinking it would race)


# A child forked while a lock is held (multiprocessing's fork, say) must not keep it alive
# after its parent dies: it closes its copies of the held descriptors.
_held: set[int] = set()


def _close_held() -> None:
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held)


def run_in_session(command: list[str], cwd: Path, log_path: Path) -> None:
    """Run `command` in a session of its own under a watchdog that kills the session when this
    process dies; on an interrupt or an exception here, kill it now. Raises BuildError."""
    read_end, write_end = os.pipe()  # EOF on read_end: this process died or gave up
    try:
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--watchdog", str(read_end),
                 *command], cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, pass_fds=(read_end,), start_new_session=True)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    try:
        code = proc.wait()
    finally:
        os.close(write_end)
        kill_session(proc.pid)  # whatever is left of it, finished or not
        proc.wait()
    if code != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-20:]
        raise BuildError(f"exit status {code}: " + "\n".join(tail))


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` but this one, until none is left (ninja puts
    each compiler in a process group of its own, so the session is what holds them all)."""
    me = os.getpid()
    for _ in range(50):
        pids = [pid for pid in _session_members(sid) if pid != me]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)


def _session_members(sid: int) -> list[int]:
    if not os.path.isdir("/proc/self"):  # no procfs: the session leader's group at least
        try:
            os.killpg(sid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # After "pid (comm)": state ppid pgrp session; a zombie is dead already.
        if int(fields[3]) == sid and fields[0] != b"Z":
            pids.append(int(entry))
    return pids


def _watchdog(argv: list[str]) -> int:
    """Run argv[1:] (this process leads its session); when argv[0], a pipe, reads EOF (the
    process that started us died or gave up), kill the session and exit."""
    fd, command = int(argv[0]), argv[1:]
    child = subprocess.Popen(command)

    def watch() -> None:
        try:
            os.read(fd, 1)
        except OSError:
            pass
        kill_session(os.getsid(0))
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    return child.wait()


if __name__ == "__main__" and sys.argv[1:2] == ["--watchdog"]:
    sys.exit(_watchdog(sys.argv[2:]))
