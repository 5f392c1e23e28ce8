"""What the engine knows of each program: the requests that named it (`Request.program_id`),
their time waiting for admission, and the tokens computed for them (prompt tokens not found in
the cache, plus generated ones).

The program's attained service, which the "plas" policy orders by, is counted along its
longest chain of calls, not summed over all of them (Autellix's ATLAS): a request starts from
the service its program had attained when it arrived, and a finished request raises the
program's to that plus its own. A sequential agent's service is the sum of its calls'; a
program that forks 8 branches counts as long as its longest branch, so a parallel program is
not pushed behind sequential ones for doing its work at once."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

from radixlm.runtime.scheduling.request import Request

MAX_PROGRAMS = 1024  # the most recently seen programs are kept; older ones are forgotten


@dataclass
class ProgramRecord:
    calls: int = 0  # requests finished
    queue_s: float = 0.0  # summed time from submission to admission
    service_tokens: int = 0  # tokens computed: prompt tokens not cached + generated tokens
    attained_tokens: int = 0  # the service along the longest chain of calls
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    last_seen: float = 0.0  # time.time() of the last finished request


class ProgramStats:
    def __init__(self, capacity: int = MAX_PROGRAMS) -> None:
        self.capacity = capacity
        self.records: OrderedDict[str, ProgramRecord] = OrderedDict()
        self.total = ProgramRecord()  # every program's, forgotten ones included

    def record(self, request: Request) -> None:
        """Count a finished request for its program (if it named one)."""
        if request.program_id is None:
            return
        record = self.records.pop(request.program_id, None) or ProgramRecord()
        self.records[request.program_id] = record  # the most recent last
        while len(self.records) > self.capacity:
            self.records.popitem(last=False)
        queue_s = (0.0 if request.admitted_time is None
                   else request.admitted_time - request.arrival_time)
        service = max(0, request.prompt_len - request.cached_tokens) + request.num_output_tokens
        record.attained_tokens = max(record.attained_tokens, request.program_service + service)
        for counts in (record, self.total):
            counts.calls += 1
            counts.queue_s += queue_s
            counts.service_tokens += service
            counts.cached_tokens += request.cached_tokens
            counts.last_seen = time.time()

    def attained(self, program_id: str | None) -> int:
        """The program's attained service so far, along its longest chain of finished calls
        (0 for none, or unknown)."""
        record = None if program_id is None else self.records.get(program_id)
        return 0 if record is None else record.attained_tokens

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {pid: asdict(record) for pid, record in self.records.items()}

    def totals(self) -> dict[str, Any]:
        """Counters over every program, for the engine's stats (and Prometheus)."""
        return {"program_calls": self.total.calls, "program_queue_seconds": self.total.queue_s,
                "program_service_tokens": self.total.service_tokens}
