"""Capturing and timing CUDA graphs, shared by the GPU benchmarks."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def capture(fn: Callable[[], object], count: int = 1) -> torch.cuda.CUDAGraph:
    """A graph of `count` back-to-back calls of fn, captured after one warm-up call on the
    capture stream (which compiles kernels and creates communicators outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(count):
            fn()
    torch.cuda.synchronize()
    return graph


def median_replay_ms(graph: torch.cuda.CUDAGraph, reps: int,
                     before: Callable[[], object] | None = None) -> float:
    """Median ms of one replay of `graph`, timed with CUDA events. `before` runs ahead of
    each replay (e.g. a barrier, so that ranks replay together)."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
