"""Building and loading the CPU decode kernel (cpu_decode.cpp), a C++ extension compiled on
first use with this machine's compiler and cached.

The build takes ~20 s on 2 cores, once per machine and torch version: it lands in
$RADIXLM_CACHE_DIR/kernels (default ~/.cache/radixlm/kernels), keyed by the source, the torch
version and the CPU's features (it is compiled for this CPU). Without a C++ compiler (or with
RADIXLM_CPU_KERNEL=0) `load()` returns None and callers keep the eager path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def load() -> ModuleType | None:
    """The compiled extension, built on the first call; None when it cannot be built here."""
    with _lock:
        if "module" not in _loaded:
            _loaded["module"] = _build()
        return _loaded["module"]


def _build() -> ModuleType | None:
    if os.environ.get("RADIXLM_CPU_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        log.warning("no C++ compiler (%s): CPU decode steps run the eager path", compiler)
        return None
    # The kernel's loops run on torch's own OpenMP threads (ATen's parallel_for compiles to
    # OpenMP directives): linked against the very runtime torch loaded, so that the process
    # keeps one thread pool. Where that runtime is not found, the loops run on one thread.
    runtime = _openmp_runtime()
    cflags = ["-O3", "-march=native"] + (["-fopenmp"] if runtime else [])
    ldflags = [runtime] if runtime else []
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()
                         + _cpu_features().encode() + " ".join(cflags + ldflags).encode()
                         ).hexdigest()[:12]
    root = Path(os.environ.get("RADIXLM_CACHE_DIR") or Path.home() / ".cache/radixlm")
    folder = root.expanduser() / "kernels" / f"cpu_decode-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load as load_extension

    name = f"radixlm_cpu_decode_{key}"
    if not any(folder.glob(f"{name}*.so")):
        log.info("compiling the CPU decode kernel (once, ~20 s) in %s", folder)
    try:
        return load_extension(name, [str(SOURCE)], build_directory=str(folder),
                              extra_cflags=cflags, extra_ldflags=ldflags, verbose=False)
    except Exception as exc:  # a compiler that fails, a missing ninja...
        log.warning("the CPU decode kernel did not build (%s): CPU decode steps run the eager "
                    "path", str(exc).splitlines()[-1] if str(exc) else type(exc).__name__)
        return None


def _openmp_runtime() -> str | None:
    """The GNU OpenMP library torch runs on, as loaded in this process (Linux), else None."""
    if not torch._C.has_openmp:
        return None
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    return paths.pop() if len(paths) == 1 else None


def _cpu_features() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)}))
