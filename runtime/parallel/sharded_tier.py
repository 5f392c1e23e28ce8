"""The prefix cache's lower tier under tensor parallelism: each rank holds its shard of every
page's KV, in a tier of its own (its own disk folder: the rank is part of the model key; its
own host memory). Rank 0 decides, as with one process; this wrapper mirrors each store and
load on the other ranks (worker.py runs them), and a finished load counts the pages every
rank loaded (a rank may lack a file another has): the rest are computed."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from concurrent.futures import Future
from typing import Any

from radixlm.runtime.parallel.sharded import TensorParallelGroup
from radixlm.runtime.parallel.step_channel import TIER_LOAD, TIER_STORE


class ShardedTier:
    def __init__(self, local: Any, group: TensorParallelGroup) -> None:
        self.local = local  # rank 0's own tier (scheduling/tiers.py)
        self.group = group
        self._loads: dict[Future, int] = {}  # rank 0's load -> its number on every rank
        self._next_load = 0

    def chain(self, tokens: Sequence[int], num_pages: int, namespace: Hashable = None,
              known: list[str] | None = None) -> list[str]:
        return self.local.chain(tokens, num_pages, namespace, known)

    def present(self, names: Sequence[str]) -> int:
        return self.local.present(names)  # what the others lack, settle takes off

    def load_async(self, names: Sequence[str], pages: Sequence[int]) -> Future:
        number, self._next_load = self._next_load, self._next_load + 1
        self.group.tier_call(TIER_LOAD, number, list(names), list(pages))
        future = self.local.load_async(names, pages)
        self._loads[future] = number
        return future

    def settle(self, future: Future, loaded: int) -> int:
        """The pages of this load every rank has (rank 0 loaded `loaded`)."""
        return self.group.tier_settle(self._loads.pop(future), loaded)

    def store(self, names: Sequence[str], pages: Sequence[int]) -> None:
        if names:
            self.group.tier_call(TIER_STORE, 0, list(names), list(pages))
            self.local.store(names, pages)

    def flush(self, timeout: float | None = None) -> None:
        self.local.flush(timeout)

    def close(self) -> None:
        self.local.close()  # the other ranks close theirs when they stop

    def stats(self) -> dict[str, Any]:
        return self.local.stats()
