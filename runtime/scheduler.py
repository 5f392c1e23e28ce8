"""Continuous batching: which requests advance by how many tokens in the next step.

There are no prefill and decode phases, only token counts. Each request has
`num_computed_tokens`, which catches up with `len(token_ids)`: a prefill chunk advances it by
the chunk, a decode step by 1. So one rule covers fresh prompts, chunked prefill, decode and
recomputation after preemption:

    new tokens for a request = min(uncomputed tokens, chunked_prefill_size, budget left)

A step first serves running requests, oldest first, then admits waiting requests (FCFS) while
the token budget, `max_running_requests` and KV pages allow. When pages run out for a running
request, the newest running request is preempted: its pages go back to the free list and it
returns to the front of the queue to be recomputed later. The oldest request can always make
progress, because a single request never needs more than the whole pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.memory import PageAllocator, ReqToTokenTable
from radixlm.runtime.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]  # per request, this step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: PageAllocator,
                 table: ReqToTokenTable) -> None:
        self.config = config
        self.allocator = allocator
        self.table = table
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        chunk = self.config.chunked_prefill_size
        batch = ScheduledBatch([], [])
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(request.num_uncomputed, chunk, budget)
            while not self._grow(request, request.num_computed_tokens + count):
                victim = self.running[-1]  # newest: not yet scheduled in this step
                self.preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break  # preempted itself: everything after it is gone too
            batch.requests.append(request)
            batch.num_new_tokens.append(count)
            budget -= count
            index += 1
        # Under memory pressure, admitting more would only preempt again.
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_running_requests):
            request = self.waiting[0]
            count = min(request.num_uncomputed, chunk, budget)
            if not self._admit(request, count):
                break
            self.waiting.popleft()
            batch.requests.append(request)
            batch.num_new_tokens.append(count)
            budget -= count
        return batch if batch.requests else None

    def _admit(self, request: Request, count: int) -> bool:
        row = self.table.acquire()
        if row is None:
            return False
        request.table_row = row
        if not self._grow(request, count):
            self.table.release(row)
            request.table_row = None
            return False
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Give the request pages for its first `num_tokens` tokens; False if none are left."""
        needed = self.allocator.pages_for(num_tokens) - len(request.pages)
        if needed <= 0:
            return True
        pages = self.allocator.allocate(needed)
        if pages is None:
            return False
        self.table.write_pages(request.table_row, len(request.pages), pages)
        request.pages.extend(pages)
        return True

    def preempt(self, request: Request) -> None:
        """Free the request's KV and queue it first, to be recomputed from scratch."""
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def finish(self, request: Request, reason: str) -> None:
        """Mark the request finished and give back its pages and table row."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _release(self, request: Request) -> None:
        self.allocator.free(request.pages)
        request.pages = []
        if request.table_row is not None:
            self.table.release(request.table_row)
            request.table_row = None
