"""A radixlm source checkout's root comes off sys.path when radixlm is imported.

A checkout's root holds lang/, runtime/ and kernels/ (pyproject maps them to radixlm,
radixlm.runtime and radixlm.kernels). With such a root on sys.path (`python -m` run from it,
`PYTHONPATH=.`, a Ray worker given its driver's working directory), kernels/ is importable as a
top-level `kernels` that shadows the Hugging Face package of that name, which transformers
imports: start-up dies with an ImportError. Nothing at a root is meant to be imported from
there, so every such entry comes off the path: this package's own checkout, and any other
radixlm checkout (a second clone sharing the environment, or the checkout an installed radixlm
is run from). Other entries stay.

`radixlm/__init__` imports this module before anything else, and every process radixlm starts
(the engine process, tensor-parallel workers, grammar compile workers, Ray replicas, servers)
imports radixlm before anything that could import transformers, so they are all covered.
"""

from __future__ import annotations

import sys
from pathlib import Path

_PACKAGES = ("lang", "runtime", "kernels")


def is_checkout_root(folder: Path) -> bool:
    """Whether `folder` is a radixlm source checkout's root: the three packages beside a
    pyproject.toml that maps lang/ into radixlm."""
    try:
        return (all((folder / name / "__init__.py").is_file() for name in _PACKAGES)
                and '"radixlm" = "lang"' in (folder / "pyproject.toml").read_text(
                    encoding="utf-8", errors="replace"))
    except OSError:
        return False


def drop_checkout_roots(path: list[str]) -> None:
    """Remove, in place, the entries of `path` (a sys.path) that are a checkout's root."""
    here = Path(__file__).resolve().parent
    own_root = here.parent if here.name == "lang" else None
    kept = []
    for entry in path:
        try:
            folder = Path(entry or ".").resolve()  # "" is the working directory
        except (OSError, RuntimeError, ValueError):
            kept.append(entry)
            continue
        if folder != own_root and not is_checkout_root(folder):
            kept.append(entry)
    path[:] = kept


drop_checkout_roots(sys.path)
