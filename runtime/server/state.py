"""What every route handler shares: the engine handle, the tokenizer, metrics, the config, and
whether the server is starting, serving or draining."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.engine_process.messages import EngineInfo
from radixlm.runtime.protocol.fields import ApiError
from radixlm.runtime.server.args import ServerConfig
from radixlm.runtime.server.heap import HeapTrimmer
from radixlm.runtime.server.metrics import Metrics
from radixlm.runtime.server.responses_store import ResponseStore
from radixlm.runtime.server.text_codec import TextCodec


@dataclass
class ServerState:
    config: ServerConfig
    engine: Any  # EngineClient, or a stand-in with the same methods (tests)
    codec: TextCodec
    model_name: str  # the id clients use on the OpenAI routes
    model_path: str | None  # what --model said (None: the default model)
    metrics: Metrics = field(init=False)  # labelled with model_name
    heap: HeapTrimmer = field(default_factory=HeapTrimmer)
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses kept
    info: EngineInfo | None = None  # set once the engine has loaded the model
    draining: bool = False  # SIGTERM received: finish what runs, take nothing new
    active_requests: int = 0  # HTTP requests being handled (what a shutdown waits for)
    started_at: float = field(default_factory=time.time)
    # LoRA adapters served ({name: {"name", "path", "rank"}}): from the engine at start, then
    # as the load and unload routes change them. A request whose `model` names one runs it.
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.model_name)

    def require_engine(self) -> EngineInfo:
        """The engine's info, or 503 while starting, after a crash, or when shutting down."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if self.info is None:
            raise ApiError(503, "the server is starting; the model is not loaded yet",
                           code="starting", headers={"Retry-After": "5"})
        if not self.engine.alive:
            raise ApiError(503, "the engine process is not running", code="engine_down")
        return self.info

    def check_room(self, wanted: int) -> None:
        """503 + Retry-After when `wanted` more samples would overfill the server. An idle
        server always takes a request (its size is capped per request, see generation.py),
        so no request can be refused forever."""
        in_flight = self.engine.in_flight
        if in_flight and in_flight + wanted > self.max_in_flight:
            raise ApiError(503, f"the server is at capacity ({in_flight} requests in "
                                f"flight); retry later", code="queue_full",
                           headers={"Retry-After": "1"})

    @property
    def max_in_flight(self) -> int:
        running = self.info.config.get("max_running_requests", 0) if self.info else 0
        return running + self.config.max_queued_requests
