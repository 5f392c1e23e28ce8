"""Building and loading the CPU decode kernel (cpu_decode.cpp), a C++ extension compiled on
first use with this machine's compiler and cached.

The build takes ~20-60 s on 2 cores, once per machine, compiler, torch and Python: it lands in
$RADIXLM_CACHE_DIR/kernels (default ~/.cache/radixlm/kernels), in a folder keyed by
everything that changes the build (`build_key`), compiled from a copy of the source inside
that folder, so checkouts and venvs with the same bytes share it and no checkout's path is in
it. kernels/build_cache.py builds it under a lock that dies with its owner and renames it into
place when done. Without a C++ compiler (or with RADIXLM_CPU_KERNEL=0) `load()` returns None
and callers keep the eager path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Sequence

import torch

from radixlm.kernels.build_cache import BuildError, cached_build

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_decode.cpp", "cpu_linear.h"))
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}

# Run by the build's own process, in the build folder: torch compiles the copy of the source
# there with ninja and imports the result (a library that does not load fails the build).
_BUILD = """import json, sys
from torch.utils.cpp_extension import load
args = json.loads(sys.argv[1])
load(args["name"], ["cpu_decode.cpp"], build_directory=".", extra_cflags=args["cflags"],
     extra_ldflags=args["ldflags"], verbose=True)
"""


def load() -> ModuleType | None:
    """The compiled extension, built on the first call; None when it cannot be built here."""
    with _lock:
        if "module" not in _loaded:
            _loaded["module"] = _build()
        return _loaded["module"]


def cache_root() -> Path:
    """Where the kernel's builds are kept: $RADIXLM_CACHE_DIR/kernels or ~/.cache/radixlm/..."""
    root = Path(os.environ.get("RADIXLM_CACHE_DIR") or Path.home() / ".cache/radixlm")
    return root.expanduser() / "kernels"


def _build() -> ModuleType | None:
    if os.environ.get("RADIXLM_CPU_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        log.warning("no C++ compiler (%s): CPU steps run the eager path (not deterministic)",
                    compiler)
        return None
    cflags, ldflags = _flags()
    key = build_key(SOURCES, cflags, ldflags, compiler)
    name = f"radixlm_cpu_decode_{key}"

    def prepare(folder: Path) -> list[str]:
        for source in SOURCES:
            shutil.copyfile(source, folder / source.name)
        args = {"name": name, "cflags": cflags, "ldflags": ldflags}
        return [sys.executable, "-c", _BUILD, json.dumps(args)]

    try:
        folder = cached_build(cache_root(), "cpu_decode", key, prepare,
                              "the CPU decode kernel")
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.so")
        if spec is None or spec.loader is None:
            raise ImportError(f"no {name}.so in {folder}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (BuildError, OSError, ImportError) as exc:  # a compiler that fails, no ninja...
        lines = str(exc).strip().splitlines()
        log.warning("the CPU decode kernel did not build (%s): CPU steps run the eager "
                    "path", lines[-1] if lines else type(exc).__name__)
        return None


def _flags() -> tuple[list[str], list[str]]:
    # The kernel's loops run on torch's own OpenMP threads (ATen's parallel_for compiles to
    # OpenMP directives): linked against the very runtime torch loaded, so that the process
    # keeps one thread pool. Where that runtime is not found, the loops run on one thread.
    # -fno-trapping-math lets loops that round (exp's 2^n, the softmax and SiLU) vectorize;
    # it changes no result, only what a floating-point trap would see.
    # RADIXLM_CPU_MARCH: the CPU to compile for, `native` (this one) unless set, e.g.
    # x86-64-v3 for any AVX2 CPU (docs/cpu.md).
    runtime = _openmp_runtime()
    march = os.environ.get("RADIXLM_CPU_MARCH", "native")
    cflags = ["-O3", f"-march={march}", "-fno-trapping-math"] + (["-fopenmp"] if runtime else [])
    return cflags, [runtime] if runtime else []


def build_key(sources: Sequence[Path], cflags: list[str], ldflags: list[str],
              compiler: str) -> str:
    """The cache folder's key: everything that changes the build and nothing that names where
    it was asked from (the sources' bytes, not their paths; a library by its file name, which
    the link records, not by the venv that holds it)."""
    flags = cflags + [os.path.basename(f) if os.path.isabs(f) else f for f in ldflags]
    parts = [
        *(source.read_bytes() for source in sources),
        "\0".join(flags),
        torch.__version__, str(getattr(torch.version, "git_version", "")),
        str(torch.compiled_with_cxx11_abi()),
        sys.version, sys.implementation.cache_tag or "", platform.machine(),
        _cpu_features(),  # -march=native compiles for this CPU
        _compiler_identity(compiler),
    ]
    digest = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else part.encode()
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:16]


def _compiler_identity(compiler: str) -> str:
    """What `compiler --version` says (its version and target), else its name."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=30, stdin=subprocess.DEVNULL)
        return done.stdout.strip() or compiler
    except (OSError, subprocess.SubprocessError):
        return compiler


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
