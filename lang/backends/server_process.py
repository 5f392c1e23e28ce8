"""A server in a child process, for benchmarks and tests: started on a free port, ready when
`/health` says so, stopped with a signal.

    with ServerProcess(["--model", "smollm2-135m-instruct"]) as server:
        requests.post(server.url + "/generate", ...)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

_LISTENING = re.compile(r"listening on (http://\S+)")


class ServerProcess:
    def __init__(self, args: Sequence[str], startup_timeout: float = 300.0,
                 env: dict[str, str] | None = None,
                 command: Sequence[str] | None = None,
                 cwd: str | Path | None = None) -> None:
        """`command` starts the server (default: this Python's `-m radixlm.runtime.server`;
        e.g. `["radixlm", "serve"]`); `args` are its flags, to which --host/--port are added.
        `env` is added to this process's environment; `cwd` is the server's working directory
        (default: this process's)."""
        self.command = list(command or [sys.executable, "-m", "radixlm.runtime.server"])
        self.args = list(args)
        self.startup_timeout = startup_timeout
        self.env = env
        self.cwd = cwd
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="radixlm-server-", suffix=".log",
                                                delete=False)

    @property
    def log_path(self) -> Path:
        return Path(self._log.name)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start(self) -> "ServerProcess":
        # --port 0: the OS picks a free port and the server's log says which, so there is
        # no window in which another process can take a port we picked.
        command = [*self.command, "--host", "127.0.0.1", "--port", "0", *self.args]
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(self.env or {})}, cwd=self.cwd)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n"
                                   f"{self.log_text()[-4000:]}")
            if not self.url:
                match = _LISTENING.search(self.log_text())
                self.url = match.group(1) if match else ""
            elif self._healthy():
                return self
            time.sleep(0.2)
        self.stop(signal.SIGKILL)
        raise TimeoutError(f"the server was not ready in {self.startup_timeout:.0f} s:\n"
                           f"{self.log_text()[-4000:]}")

    def engine_pid(self) -> int:
        """The pid of the server's engine process (Linux only: read from /proc). The server
        does not report it: its info routes show nothing about the machine."""
        assert self.proc is not None
        pid = self.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for child in children:
            command = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in command:  # multiprocessing's spawn entry point
                return int(child)
        raise LookupError(f"no engine process among the children {children} of {pid}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Signal the server and wait for it; its exit code (None if it had to be killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.close()
        self.log_path.unlink(missing_ok=True)
