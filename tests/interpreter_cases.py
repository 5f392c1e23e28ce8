"""Running a test file's Triton kernel cases under the Triton interpreter, on CPU.

TRITON_INTERPRET must be set before triton is imported, so the cases (`case_*` functions of
a test file) run in subprocesses that execute the file itself as a script, one per core
(up to WORKERS) each taking the next case not yet taken: the interpreter is single-threaded
Python.
The test process reads back one JSON line of results from each and turns each case into a
test.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Iterator

import pytest
import torch


def collect_cases(namespace: dict[str, Any]) -> list[str]:
    return sorted(name[len("case_"):] for name in namespace if name.startswith("case_"))


WORKERS = 2  # interpreter processes per test file, at most one per core


def _next_case(counter: str | None, names: list[str]) -> Iterator[str]:
    """The cases this process runs: all of them, or with a `counter` file shared by the
    workers, each next one no worker has taken yet (taken under a lock on the file)."""
    if counter is None:
        yield from names
        return
    while True:
        with open(counter, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            taken = int(f.read() or 0)
            f.seek(0)
            f.write(str(taken + 1))
            f.truncate()
        if taken >= len(names):
            return
        yield names[taken]


def run_cases(namespace: dict[str, Any], counter: str | None = None,
              workers: int = 1) -> dict[str, dict]:
    """Run a module's cases (in an interpreter process; with a `counter`, those this worker
    takes, see _next_case); one failure does not stop the others."""
    torch.set_num_threads(max(1, 2 // workers))
    results = {}
    for name in _next_case(counter, collect_cases(namespace)):
        start = time.perf_counter()
        try:
            detail, ok = namespace["case_" + name](), True
        except Exception:  # report, and go on with the other cases
            detail, ok = traceback.format_exc(), False
        results[name] = {"ok": ok, "detail": detail,
                         "seconds": round(time.perf_counter() - start, 2)}
    return results


def results_under_interpreter(test_file: str) -> dict[str, dict]:
    """Run `test_file` as a script with TRITON_INTERPRET=1 and return its case results."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    if platform.machine().lower() in ("x86_64", "amd64"):
        # The interpreter's tl.dot is numpy's matmul. OpenBLAS's FMA kernels (Haswell, Zen)
        # sum a row differently by where it falls in their register tiles, so a row's product
        # changed with the rows around it, which batch-invariance cases check; a GPU's dot
        # does not. Its AVX kernel without FMA sums every row alike (checked on an AMD EPYC
        # without AVX-512; an x86 CPU with AVX-512 picked kernels that did too).
        env.setdefault("OPENBLAS_CORETYPE", "Sandybridge")
    workers = max(1, min(WORKERS, os.cpu_count() or 1))
    counter = tempfile.NamedTemporaryFile("w", suffix=".cases", delete=False)
    counter.close()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(test_file), counter.name,
                               str(workers)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(workers)]
    results: dict[str, dict] = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            lines = out.strip().splitlines()
            if proc.returncode != 0 or not lines:
                pytest.fail(f"interpreter run failed ({proc.returncode}):\n{err[-4000:]}")
            results.update(json.loads(lines[-1]))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        os.unlink(counter.name)
    return results


def main(namespace: dict[str, Any]) -> None:
    """The script entry point of a test file with interpreter cases."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    counter, workers = (sys.argv[1], int(sys.argv[2])) if len(sys.argv) > 2 else (None, 1)
    print(json.dumps(run_cases(namespace, counter, workers)))
