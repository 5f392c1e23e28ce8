"""The arithmetic of benchmark scripts' summaries, on data whose answer is known."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def one_batch(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import one_batch

    return one_batch


def test_a_trace_summary_counts_steady_steps_busy_idle_and_kinds(one_batch):
    """one_batch.py --trace-steps: steps run from one graph replay's first kernel to the
    next; the first two are left out; busy time is the union of the device's intervals."""
    device = [(0, 5, "warm-up"), (10, 18, "decode_split_kernel"), (20, 28, "nvjet gemm"),
              (30, 38, "decode_split_kernel"), (34, 36, "_rms_norm_kernel"),
              (40, 48, "nvjet gemm"), (50, 58, "decode_split_kernel"), (60, 62, "x")]
    launches = [0, 9, 19.5, 39.5, 59.5]  # host times of the graph launches
    summary = one_batch.summarize_trace(device, launches, steps=5)
    assert summary["steps"] == 2
    assert summary["step_ms"] == pytest.approx(0.020)  # 20 us .. 60 us over two steps
    assert summary["busy_ms"] == pytest.approx(0.016)  # the overlapping norm counted once
    assert summary["idle_ms"] == pytest.approx(0.004)
    assert summary["busy_ms_by_kind"] == pytest.approx(
        {"matmul": 0.008, "attention": 0.008, "norm": 0.001})
    # Without graph launches: the whole window over the steps traced.
    eager = one_batch.summarize_trace(device, [], steps=2)
    assert eager["step_ms"] == pytest.approx(0.031)
