"""Overlap scheduling: the step that may be launched while the previous one is still on the
device.

The engine launches a follow-up decode step before the previous step's tokens reach the host:
every request the previous step sampled for decodes the token it sampled, read on the device
(`ScheduledBatch.pending_tokens`). That is only valid when it is the step the scheduler would
pick anyway, which this module decides from what the host knows before the tokens arrive.
"""

from __future__ import annotations

import torch

from radixlm.kernels.host_copy import to_device
from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.execution.step_result import LaunchedStep
from radixlm.runtime.scheduling.kv_manager import KVManager
from radixlm.runtime.scheduling.scheduler import ScheduledBatch, Scheduler


def follow_up_batch(prev: LaunchedStep, scheduler: Scheduler, kv: KVManager,
                    config: EngineConfig, grammars_compiling: bool) -> ScheduledBatch | None:
    """The step after `prev`, or None when the scheduler must decide once prev's tokens are
    on the host.

    A follow-up needs: every running request sampled by prev (none is prefilling), nobody
    waiting for admission while there is room, no grammar compile to attach, and no request
    that needs its newest token on the host to sample the next (a grammar mask, penalties, a
    min_new_tokens ban). A request whose prev token is its last by length is left out. A stop
    string or EOS is only seen once prev is post-processed: that request's follow-up token is
    computed and dropped. Grows each follower's pages for the pending token.
    """
    requests = prev.sampled
    if (prev.tokens is None or prev.failed or len(requests) != len(scheduler.running)
            or len(requests) > config.max_num_batched_tokens or grammars_compiling
            or scheduler.waiting and len(scheduler.running) < config.max_running_requests):
        return None
    keep = []
    for index, request in enumerate(requests):
        params = request.params
        if (request.finished or request.grammar is not None or params.has_penalties
                or request.num_output_tokens + 1 < params.min_new_tokens):
            return None
        if request.remaining_new_tokens > 1:  # room for more than the pending token
            keep.append(index)
    followers = [requests[i] for i in keep]
    if not followers:
        return None
    for request in followers:  # room for the pending token, at position len(token_ids)
        if not kv.grow(request, len(request.token_ids) + 1):
            return None
    tokens = (prev.tokens if len(keep) == len(requests)
              else prev.tokens[to_device(keep, torch.int64, prev.device)])
    return ScheduledBatch(followers, [1] * len(followers), tokens)
