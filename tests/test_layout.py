"""The runtime's layout is its architecture: imports point down the layers drawn in
docs/architecture.md, and that page names exactly the modules that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"lang": "radixlm", "runtime": "radixlm.runtime", "kernels": "radixlm.kernels"}

# Each unit and the units it may import (besides itself). `runtime` is the package's own lazy
# exports (Engine, SamplingParams, ...), which resolve into the engine layer.
_BELOW_EXECUTION = {"scheduling", "models", "attention", "parallel.groups", "config", "grammar",
                    "kernels"}
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "grammar": set(),
    "parallel.groups": {"kernels"},
    "config": {"grammar"},
    "attention": {"kernels"},
    "models": {"attention", "parallel.groups", "kernels"},
    "scheduling": {"config", "kernels"},
    "execution": _BELOW_EXECUTION,
    "parallel.sharded": {"models", "attention", "parallel.groups", "config", "kernels"},
    "parallel.worker": _BELOW_EXECUTION | {"execution", "parallel.sharded"},
    "engine": _BELOW_EXECUTION | {"execution", "parallel.sharded"},
    # Replicas on Ray: routing.py imports nothing of the runtime, replicas.py only Ray.
    "distributed": set(),
    "server": {"runtime", "engine", "config", "scheduling", "models", "grammar", "distributed"},
    "cli": {"runtime", "server", "engine", "config", "models"},
    "runtime": {"engine", "config", "scheduling"},
}


def unit_of(module: str) -> str:
    parts = module.split(".")
    if parts[:2] == ["radixlm", "kernels"]:
        return "kernels"
    if parts[:2] != ["radixlm", "runtime"]:
        return "lang"
    if len(parts) == 2:
        return "runtime"
    if parts[2] == "parallel" and len(parts) > 3:
        return f"parallel.{parts[3]}"
    return parts[2]


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join([package, *parts]).removesuffix(".__init__")
            found[name] = path
    return found


def imported(path: Path, known: set[str]) -> set[str]:
    """The radixlm modules a file imports, at any depth of the file (lazy imports count)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                names.add(sub if sub in known else node.module)
    return {n for n in names if n == "radixlm" or n.startswith("radixlm.")}


def test_imports_point_down_the_layers():
    found = modules()
    wrong = []
    for name, path in found.items():
        src = unit_of(name)
        if src == "lang":
            continue  # the language sits on top and may use any runtime layer
        for target in imported(path, set(found)):
            dst = unit_of(target)
            if dst != src and dst not in ALLOWED[src]:
                wrong.append(f"{path.relative_to(ROOT)}: {src} imports {dst} ({target})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_only_the_cli_sits_directly_under_runtime():
    loose = {p.name for p in (ROOT / "runtime").glob("*.py")}
    assert loose == {"__init__.py", "cli.py"}


def test_every_subpackage_says_what_it_owns():
    for init in (ROOT / "runtime").rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(ROOT)} needs a docstring saying what it owns"


def test_architecture_page_names_every_module():
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = {m.group(1) for m in re.finditer(r"^\| `([\w/]+\.py)` \|", page, re.M)}
    on_disk = set()
    for path in modules().values():
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(ROOT)
        on_disk.add(str(rel.relative_to("runtime")) if rel.parts[0] == "runtime" else str(rel))
    on_disk = {"runtime/cli.py" if p == "cli.py" else p for p in on_disk}
    on_disk = {p for p in on_disk if not p.startswith("lang/")}
    assert on_disk - table == set(), "modules missing from docs/architecture.md"
    assert table - on_disk == set(), "docs/architecture.md names modules that do not exist"
