"""Running a test file's Triton kernel cases under the Triton interpreter, on CPU.

TRITON_INTERPRET must be set before triton is imported, so the cases (`case_*` functions of
a test file) run in a subprocess that executes the file itself as a script; the test process
reads back one JSON line of results and turns each case into a test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

import pytest
import torch


def collect_cases(namespace: dict[str, Any]) -> list[str]:
    return sorted(name[len("case_"):] for name in namespace if name.startswith("case_"))


def run_cases(namespace: dict[str, Any]) -> dict[str, dict]:
    """Run every case of a module (in the interpreter process); one failure does not stop
    the others."""
    torch.set_num_threads(2)
    results = {}
    for name in collect_cases(namespace):
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
    proc = subprocess.run([sys.executable, os.path.abspath(test_file)], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(f"interpreter run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def main(namespace: dict[str, Any]) -> None:
    """The script entry point of a test file with interpreter cases."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    print(json.dumps(run_cases(namespace)))
