"""Continuous batching: which requests advance by how many tokens in the next step.

There are no prefill and decode phases, only token counts. Each request has
`num_computed_tokens`, which catches up with `len(token_ids)`: a prefix-cache hit advances it
for free, a prefill chunk by the chunk, a decode step by 1. So one rule covers fresh prompts,
cached prefixes, chunked prefill, decode and recomputation after a retraction:

    new tokens for a request = min(uncomputed tokens, chunked_prefill_size, budget left)

A step first serves running requests, oldest first, then admits waiting requests while the
token budget, `max_running_requests` and KV pages allow. Waiting requests are taken by their
`priority` (lower first), then (with `program_policy="plas"`) by how much service their program
has had, in doubling levels that waiting raises, then by their rank in the server request they
came with (`Request.queue_rank`), then in arrival order: a client's first prompt never waits
behind another client's 1000-prompt batch. With "plas", when every running slot is taken, a
much less served program's request preempts the most served program's running one. A request
whose grammar is still compiling holds back its last token (`held_back_tokens`) and is
skipped once the rest is computed, so it never holds up the batch. With the "lpm" policy the waiting
queue is ordered by longest cached prefix, and a request that shares a not-yet-cached prefix
with one being prefilled waits a step, so that it hits the cache instead of recomputing.

Memory pressure degrades in stages: evict unlocked cached pages (inside KVManager.grow), then
retract a running request (least progress first): its computed pages go to the cache, the
rest back to the free list, and it is requeued; admission then reserves more room for
decoding (`reserve_ratio`) so the engine does not thrash. The oldest running request can
always progress: one request never needs more than the whole pool.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.scheduling.kv_manager import KVManager, TierLoad
from radixlm.runtime.scheduling.program_stats import ProgramStats
from radixlm.runtime.scheduling.request import Request, RequestStatus

# Longest-prefix-match ordering costs a cache lookup per waiting request per step; above
# this queue length fall back to FCFS so the cost stays bounded.
LPM_QUEUE_LIMIT = 128
# The "plas" program policy: a program's first level holds up to this many tokens of attained
# service, each next level twice as many; a waiting request rises a level every AGING_S.
PLAS_QUANTUM = 256
PLAS_AGING_S = 2.0
# When every running slot is taken, a waiting request preempts the running request of the
# most served program if its own program is at least this many levels less served.
PLAS_PREEMPT_LEVELS = 2
# Fraction of each running request's remaining decode tokens that admission keeps free.
RESERVE_RATIO_INIT, RESERVE_RATIO_MIN, RESERVE_RATIO_DECAY = 0.5, 0.1, 0.002


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]  # per request, this step
    # Set when this step follows one still running on the device (overlap scheduling): each
    # request computes one token, the one that step samples for it, read from this device
    # tensor ([len(requests)]) rather than from token_ids, which does not hold it yet.
    pending_tokens: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_retractions = 0
        self.num_preemptions = 0  # running requests put back for a less served program's
        self.num_cached_tokens = 0  # prompt tokens served from the cache, at first admission
        self.reserve_ratio = RESERVE_RATIO_INIT
        # Per-program counters (finished calls), and the attained service "plas" orders by.
        self.programs = ProgramStats()
        self.plas = config.program_policy == "plas"

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.program_service = self.programs.attained(request.program_id)
        self.waiting.append(request)

    def schedule(self, busy: frozenset[Request] | set[Request] = frozenset(),
                 shares: int = 1) -> ScheduledBatch | None:
        """The next step's batch. With pipeline parallelism, `busy` requests are in a batch
        still in the pipeline (they are neither scheduled nor retracted) and the running and
        waiting requests are cut into `shares` batches of about equal size, one per stage,
        so that every stage has work."""
        batch = ScheduledBatch([], [])
        if self.plas and self.waiting and len(self.running) >= self.config.max_running_requests:
            self._preempt_for_waiting(busy)
        limit = max(1, -(-(len(self.running) + len(self.waiting)) // shares))
        retractions = self.num_retractions
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens, busy, limit)
        if self.num_retractions > retractions:  # memory is short: admit nothing new
            self.reserve_ratio = 1.0
        else:
            self.reserve_ratio = max(RESERVE_RATIO_MIN, self.reserve_ratio - RESERVE_RATIO_DECAY)
            self._admit_waiting(batch, budget, limit)
        return batch if batch.requests else None

    def _schedule_running(self, batch: ScheduledBatch, budget: int,
                          busy: frozenset[Request] | set[Request], limit: int) -> int:
        chunk = self.config.chunked_prefill_size
        running = [r for r in self.running if r not in busy] if busy else list(self.running)
        index = 0
        while index < len(running) and budget > 0 and len(batch.requests) < limit:
            request = running[index]
            count = min(request.num_uncomputed - request.held_back_tokens, chunk, budget)
            if count <= 0:  # waiting for its grammar; the rest of the batch goes on
                index += 1
                continue
            while not self.kv.grow(request, request.num_computed_tokens + count):
                # Only requests not yet in this batch (nor in flight) can give their pages
                # back.
                victim = min(running[index:], key=self._retraction_order)
                self.retract(victim)
                running.remove(victim)
                if victim is request:
                    return budget
            batch.requests.append(request)
            batch.num_new_tokens.append(count)
            budget -= count
            index += 1
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, limit: int) -> None:
        chunk = self.config.chunked_prefill_size
        lpm = self.config.schedule_policy == "lpm" and self.kv.cache is not None
        candidates = list(self.waiting)
        hits: dict[Request, int] = {}
        if lpm and len(candidates) <= LPM_QUEUE_LIMIT:
            hits = {r: self.kv.match(r) for r in candidates}
        if hits or self.plas or any(r.queue_rank or r.priority for r in candidates):
            # Retracted requests first, then by priority, then (plas) by the program's
            # service level, then fair share (by rank in their batch), then the longest
            # cached prefix; the sort is stable: FCFS among equals.
            now = time.perf_counter()
            candidates.sort(key=lambda r: (not r.admitted or r.preempted, r.priority,
                                           self._level(r, now) if self.plas else 0,
                                           0 if r.admitted else r.queue_rank,
                                           -hits.get(r, 0)))
        prefilling = [r for r in self.running if r.num_computed_tokens < r.prompt_len]
        # LoRA adapters in the running batch: at most max_loras_per_batch (their slots).
        adapters = {id(r.lora) for r in self.running if r.lora is not None}
        for request in candidates:
            if (budget <= 0 or len(self.running) >= self.config.max_running_requests
                    or len(batch.requests) >= limit):
                break
            if (request.lora is not None and id(request.lora) not in adapters
                    and len(adapters) >= self.config.max_loras_per_batch):
                continue  # no slot for its adapter until one leaves the batch; others may fit
            if lpm and _shares_uncached_prefix(request, hits.get(request, 0), prefilling,
                                               self.kv.page_size):
                continue  # wait for the other request's prefill to land in the cache
            if request.num_uncomputed - request.held_back_tokens <= 0:
                continue  # nothing to compute until its grammar is ready
            # Pages come back from running requests, and from loads in flight (their
            # requests run next): while either holds some, a prefix waits for all its room.
            load = self.kv.start_load(request,
                                      wait_for_room=bool(self.running) or self.kv.loading)
            if load is TierLoad.LOADING:
                continue  # its prefix is coming from a lower tier; others run meanwhile
            if load is TierLoad.NO_ROOM:
                break  # as for a prompt that does not fit: wait for running requests' pages
            if not self._fits(request, hits.get(request, 0)):
                break
            if not self.kv.attach(request):
                break
            count = min(request.num_uncomputed - request.held_back_tokens, chunk, budget)
            if count <= 0:  # the cache holds all but the held-back token
                self.kv.release(request)
                request.num_computed_tokens = 0
                continue
            if not self.kv.grow(request, request.num_computed_tokens + count):
                self.kv.release(request)
                request.num_computed_tokens = 0
                break
            self.waiting.remove(request)
            request.preempted = False
            if not request.admitted:
                request.admitted = True
                request.admitted_time = time.perf_counter()
                request.cached_tokens = request.num_computed_tokens
                self.num_cached_tokens += request.cached_tokens
            request.status = RequestStatus.RUNNING
            if request.lora is not None:
                adapters.add(id(request.lora))
            self.running.append(request)
            prefilling.append(request)
            batch.requests.append(request)
            batch.num_new_tokens.append(count)
            budget -= count

    def _preempt_for_waiting(self, busy: frozenset[Request] | set[Request]) -> None:
        """"plas" with every running slot taken: the waiting requests of the least served
        programs take the slots of the running requests of the most served ones (not those
        in flight), where the levels differ by PLAS_PREEMPT_LEVELS or more (an explicit
        priority outranks levels). A preempted request is retracted (what it computed goes
        to the cache, so it resumes with a cache hit) and waits by its own level; aging
        raises it, so it comes back and is soon too old to be preempted again."""
        now = time.perf_counter()
        waiting = sorted((r for r in self.waiting
                          if r.num_uncomputed - r.held_back_tokens > 0 and r.lora is None),
                         key=lambda r: (r.priority, self._level(r, now)))
        running = sorted((r for r in self.running if r not in busy),
                         key=lambda r: (r.priority, self._level(r, now)), reverse=True)
        for candidate, victim in zip(waiting, running):
            if ((candidate.priority, self._level(candidate, now) + PLAS_PREEMPT_LEVELS)
                    > (victim.priority, self._level(victim, now))):
                break
            self._requeue(victim)
            victim.preempted = True
            self.waiting.append(victim)
            self.num_preemptions += 1

    def _fits(self, request: Request, hit: int) -> bool:
        """Admission control: the new request's uncached tokens plus a reserve for what the
        running requests (and this one) may still decode must fit in the available pages."""
        if not self.running:
            return True  # alone, any request fits: max_model_len <= pool size
        page = self.kv.page_size
        reserve = sum(-(-int(r.remaining_new_tokens * self.reserve_ratio) // page)
                      for r in self.running)
        own = -(-(len(request.token_ids) - hit
                  + int(request.remaining_new_tokens * self.reserve_ratio)) // page)
        return own + reserve <= self.kv.available_pages

    def _level(self, request: Request, now: float) -> int:
        """The request's "plas" level: its program's attained service, raised by waiting."""
        return (_service_level(request.program_service)
                - int((now - request.arrival_time) / PLAS_AGING_S))

    def _retraction_order(self, request: Request) -> tuple[int, int, int, float]:
        """The lowest priority (the highest value) first, then (plas) the program that had
        the most service, then the least generated, the newest among equals."""
        level = _service_level(request.program_service) if self.plas else 0
        return (-request.priority, -level, request.num_output_tokens, -request.arrival_time)

    def retract(self, request: Request) -> None:
        """Stop a running request to free memory: cache what it computed, requeue it first.
        It resumes from its prompt and the tokens it already generated, so its output does
        not change."""
        self._requeue(request)
        self.waiting.appendleft(request)
        self.num_retractions += 1

    def _requeue(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING

    def finish(self, request: Request, reason: str) -> None:
        """Mark the request finished; its computed pages go to the cache, the rest are freed."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv.release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason


def _service_level(service: int) -> int:
    """0 below PLAS_QUANTUM tokens, 1 below twice that, 2 below four times, ..."""
    return (service // PLAS_QUANTUM).bit_length()


def _shares_uncached_prefix(request: Request, hit: int, others: list[Request],
                            page_size: int) -> bool:
    """Would waiting a step let this request reuse at least one more page that another
    request is computing right now?"""
    want = hit + page_size
    tokens = request.token_ids
    if len(tokens) <= want:
        return False
    head = tokens[:want]
    return any(other is not request and other.token_ids[:want] == head for other in others)
