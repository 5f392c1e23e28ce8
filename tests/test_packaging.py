"""Every Python package folder under lang/, runtime/ and kernels/ must be listed in
pyproject.toml, or `pip install .` (non-editable) silently ships without it."""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"lang": "radixlm", "runtime": "radixlm.runtime", "kernels": "radixlm.kernels"}


def test_every_subpackage_is_listed():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    mapping = pyproject["tool"]["setuptools"]["package-dir"]
    assert {v: k for k, v in mapping.items()} == FOLDERS
    found = set()
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    missing = found - listed
    assert not missing, f"add these to [tool.setuptools] packages: {sorted(missing)}"
    assert not listed - found, f"listed but not present: {sorted(listed - found)}"


def test_console_script_is_declared():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["radixlm"] == "radixlm.runtime.cli:main"


def test_non_python_sources_ship_as_package_data():
    """Files a package reads at run time (the C++ kernel compiled on first use) must be
    package data, or an installed wheel lacks them."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]
    for folder, package in FOLDERS.items():
        for source in (ROOT / folder).rglob("*.cpp"):
            assert source.suffix in {Path(p).suffix for p in data.get(package, [])}, source
