"""Every example runs: the program examples on one shared engine with small token budgets (the
same result with segments and one call per gen), and `make demo` (examples/demo.py) as a user
would run it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import radixlm as rl
from radixlm.runtime import Engine

FOLDER = Path(__file__).resolve().parent.parent / "examples"
EXAMPLES = sorted(p for p in FOLDER.glob("*.py") if p.name != "demo.py")


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def without_ids(result: list) -> list:
    """A result without tool calls' ids (random on every run)."""
    return [{k: v for k, v in item.items() if k != "id"} if isinstance(item, dict) else item
            for item in result]


@pytest.fixture(scope="module")
def backend(default_model_folder):
    with Engine(str(default_model_folder)) as engine:
        yield rl.Engine(engine=engine)


def test_examples_stay_short():
    for path in [*EXAMPLES, FOLDER / "demo.py"]:
        assert len(path.read_text().splitlines()) <= 80, f"{path.name}: examples stay short"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, backend, capsys):
    result = load(path).main(backend, max_tokens=48)
    assert result, "an example returns what it showed"
    assert capsys.readouterr().out.strip(), "an example prints its result"
    # Segments (on by default) change how the program reaches the engine, not its output.
    per_call = rl.Engine(engine=backend.engine)
    per_call.supports_segments = False
    assert without_ids(load(path).main(per_call, max_tokens=48)) == without_ids(result)
    if path.stem == "few_shot_qa":
        assert result[:3] == ["Paris", "Tokyo", "Rome"]
    elif path.stem == "classify":
        assert result == ["Positive", "Negative", "Positive", "Negative"]
    elif path.stem == "react_agent":
        assert result == ["437", "Tokyo"]
    elif path.stem == "tool_agent":
        assert [(c["name"], c["arguments"]) for c in result] == [
            ("get_weather", {"city": "Tokyo"}), ("get_weather", {"city": "Oslo"})]
    elif path.stem == "json_extraction":
        assert [p["age"] for p in result] == [34, 27]
    assert backend.stats()["leases"] == 0


def test_demo_runs(default_model_folder):
    result = subprocess.run([sys.executable, str(FOLDER / "demo.py")], capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "prefix cache" in result.stdout
