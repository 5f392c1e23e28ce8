"""Timing captured CUDA graphs, shared by the GPU benchmarks."""

from __future__ import annotations

import statistics

import torch


def median_replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median ms of one replay of `graph`, timed with CUDA events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
