"""`rl.Runtime(model)`: a `radixlm serve` server in a child process, as a backend.

    runtime = rl.Runtime("HuggingFaceTB/SmolLM2-135M-Instruct", max_running_requests=32)
    rl.set_default_backend(runtime)
    ...
    runtime.shutdown()

Keyword arguments are the server's flags (`max_running_requests=32` is
`--max-running-requests 32`; True is a bare flag). It is a `RuntimeEndpoint` on the server's
address, and stops the server on `shutdown()`, `close()` or leaving a `with` block.
"""

from __future__ import annotations

from typing import Any

from radixlm.backends.runtime_endpoint import RuntimeEndpoint
from radixlm.backends.server_process import ServerProcess


class Runtime(RuntimeEndpoint):
    def __init__(self, model: str | None = None, *, model_path: str | None = None,
                 startup_timeout: float = 300.0, **flags: Any) -> None:
        if model is not None and model_path is not None:
            raise TypeError("Runtime: give the model once (model or model_path)")
        model = model if model is not None else model_path
        args = [] if model is None else ["--model", model]
        for name, value in flags.items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                args.append(flag)
            elif value not in (False, None):
                args += [flag, str(value)]
        self.server = ServerProcess(args, startup_timeout=startup_timeout).start()
        self.url = self.server.url
        try:
            super().__init__(self.server.url)
        except BaseException:
            self.server.stop()
            raise

    @property
    def endpoint(self) -> "Runtime":
        """SGLang's name for the client side of a runtime: this object itself."""
        return self

    def shutdown(self) -> None:
        self.server.stop()

    def close(self) -> None:
        self.shutdown()
