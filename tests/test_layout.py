"""The package's layout is its architecture: every folder is one layer, imports point down the
layers drawn in docs/architecture.md, nothing imports in a cycle (function-level imports and the
registries' module names included), and that page names exactly the modules that exist."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"lang": "radixlm", "runtime": "radixlm.runtime", "kernels": "radixlm.kernels"}

# The layers, top to bottom, and what each may import besides itself. A layer is a folder
# (`lang` is the language's folder with its backends/ and compat/; `runtime` is the package's own
# lazy exports, `cli` the one loose module). Every entry may only name layers below it.
LAYERS: dict[str, set[str]] = {
    "lang": {"programs", "protocol", "engine", "scheduling", "config"},
    "cli": {"server", "quantize", "runtime", "models", "config"},
    "server": {"replicas", "engine_process", "engine", "models", "programs", "protocol", "config",
               "grammar"},
    "replicas": {"engine_process", "engine", "distributed"},  # ray_actors: Ray's cluster
    "engine_process": {"engine"},
    "quantize": {"models", "attention"},
    "runtime": {"engine", "scheduling", "config"},
    "engine": {"parallel", "execution", "scheduling", "models", "attention", "distributed",
               "config", "grammar", "kernels"},
    "parallel": {"execution", "scheduling", "models", "attention", "distributed", "config"},
    "execution": {"scheduling", "models", "attention", "config", "kernels"},
    "scheduling": {"config", "kernels"},
    "models": {"attention", "distributed", "kernels"},
    "attention": {"kernels"},
    "distributed": {"kernels"},
    "programs": set(),
    "protocol": {"config"},
    "config": {"grammar"},
    "grammar": set(),
    "kernels": set(),
}

def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[:2] == ["radixlm", "kernels"]:
        return "kernels"
    if parts[:2] != ["radixlm", "runtime"]:
        return "lang"
    return parts[2] if len(parts) > 2 else "runtime"


def folder_of(module: str, path: Path) -> str:
    """The folder a module is in; a package's `__init__` (its registry and exports) counts as a
    unit of its own, above the folder's other modules."""
    return module + ".__init__" if path.name == "__init__.py" else module.rpartition(".")[0]


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join([package, *parts]).removesuffix(".__init__")
            found[name] = path
    return found


def imported(path: Path, known: set[str]) -> set[str]:
    """The radixlm modules a file imports: import statements at any depth of the file (lazy
    imports count), and module names in strings (registries that import on first use)."""
    names: set[str] = set()
    skipped: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                names.add(sub if sub in known else node.module)
        elif isinstance(node, (ast.List, ast.Tuple)):
            # A module started as a process (`-m radixlm....`) is run, not imported.
            started = {id(b) for a, b in zip(node.elts, node.elts[1:])
                       if isinstance(a, ast.Constant) and a.value == "-m"}
            skipped.update(started)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and "." in node.value and node.value in known and id(node) not in skipped):
            names.add(node.value)
    return {n for n in names if n == "radixlm" or n.startswith("radixlm.")}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(path, set(found)) - {name} for name, path in found.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_imports_are_absolute():
    """Relative imports would hide from the checks below (and DESIGN.md asks for absolute)."""
    relative = [str(path.relative_to(ROOT)) for path in modules().values()
                if any(isinstance(node, ast.ImportFrom) and node.level
                       for node in ast.walk(ast.parse(path.read_text())))]
    assert not relative, f"relative imports in {relative}"


def test_the_layer_table_points_down():
    order = list(LAYERS)
    for layer, allowed in LAYERS.items():
        above = {a for a in allowed if order.index(a) <= order.index(layer)}
        assert not above, f"{layer} may import {above}, which are not below it"


def test_imports_point_down_the_layers():
    found = modules()
    wrong = []
    for name, targets in import_graph().items():
        src = layer_of(name)
        for target in targets:
            dst = layer_of(target)
            if dst != src and dst not in LAYERS[src]:
                wrong.append(f"{found[name].relative_to(ROOT)}: {src} imports {dst} ({target})")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_module_imports_in_a_cycle():
    found = cycle(import_graph())
    assert found is None, "import cycle: " + " -> ".join(found or [])


def test_no_folders_import_each_other():
    found = modules()
    folders: dict[str, set[str]] = defaultdict(set)
    for name, targets in import_graph().items():
        src = folder_of(name, found[name])
        for target in targets:
            dst = folder_of(target, found[target])
            if dst != src:
                folders[src].add(dst)
    loop = cycle(folders)
    assert loop is None, "folders importing each other: " + " -> ".join(loop or [])


def test_only_the_cli_sits_directly_under_runtime():
    loose = {p.name for p in (ROOT / "runtime").glob("*.py")}
    assert loose == {"__init__.py", "cli.py"}


def test_every_layer_in_the_table_is_a_folder():
    folders = {p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").exists()}
    assert folders | {"lang", "cli", "runtime", "kernels"} == set(LAYERS)


def test_every_package_says_what_it_owns():
    for folder in FOLDERS:
        for init in (ROOT / folder).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc, f"{init.relative_to(ROOT)} needs a docstring saying what it owns"


def test_module_names_say_which_thing_they_are():
    """No `base.py` or `utils.py` (three `base.py` make imports ambiguous to a reader), and no
    module named like another runtime folder (a `config.py` beside the `config/` folder)."""
    folders = {p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").exists()}
    vague = {"base", "util", "utils", "common", "helpers", "misc"}
    wrong = sorted(str(path.relative_to(ROOT)) for path in modules().values()
                   if path.stem in vague or (path.stem in folders
                                             and path.stem != path.parent.name))
    assert not wrong, f"modules whose names do not say what they are: {wrong}"


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
    assert on_disk - table == set(), "modules missing from docs/architecture.md"
    assert table - on_disk == set(), "docs/architecture.md names modules that do not exist"
