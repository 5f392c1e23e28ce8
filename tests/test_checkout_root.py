"""Run from a source checkout's root, or with it on PYTHONPATH, radixlm and every process it
starts must not import the checkout's lang/, runtime/ or kernels/ as top-level packages:
kernels/ would shadow the Hugging Face `kernels` package that transformers imports, and
start-up would die with an ImportError (radixlm/source_checkout.py).

"This" checkout is the one radixlm is imported from; "another" is a second checkout (a clone
sharing this environment, or the checkout an installed radixlm is run from), whose packages
record any import of them and fail it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from radixlm.backends.server_process import ServerProcess
from radixlm.source_checkout import is_checkout_root

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lang", "runtime", "kernels")


@pytest.fixture
def another_checkout(tmp_path) -> Path:
    folder = tmp_path / "checkout"
    for name in PACKAGES:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(
            "import os, pathlib\n"
            "with open(pathlib.Path(__file__).parent.parent / 'imported.txt', 'a') as f:\n"
            f"    f.write(f'{{os.getpid()}} {name}\\n')\n"
            f"raise ImportError('the checkout at {folder} was imported as top-level {name}')\n")
    shutil.copy(ROOT / "pyproject.toml", folder / "pyproject.toml")
    return folder


def _imported(checkout: Path) -> str:
    marker = checkout / "imported.txt"
    return marker.read_text() if marker.exists() else ""


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_checkout_roots_are_recognised(tmp_path, another_checkout):
    assert is_checkout_root(ROOT) and is_checkout_root(another_checkout)
    # The same folders without our pyproject are someone else's project: left alone.
    (another_checkout / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert not is_checkout_root(another_checkout)
    assert not is_checkout_root(tmp_path / "missing")


@pytest.mark.parametrize("which", ["this", "another"])
def test_engine_with_the_checkout_on_pythonpath(which, tiny_chat_model, another_checkout):
    """`PYTHONPATH=.` in the checkout: the interpreter and its tensor-parallel workers."""
    checkout = ROOT if which == "this" else another_checkout
    code = (
        "import importlib.util, json, sys\n"
        "from radixlm.runtime.engine.engine import Engine\n"
        f"with Engine({str(tiny_chat_model)!r}, dtype='float32', device='cpu', tp_size=2,\n"
        "            tp_timeout=60, max_total_tokens=4096) as engine:\n"
        "    out = engine.generate(input_ids=[[1, 5, 9]],\n"
        "                          sampling_params={'max_new_tokens': 4, 'temperature': 0})[0]\n"
        "specs = {n: getattr(importlib.util.find_spec(n), 'origin', None)\n"
        f"         for n in {PACKAGES!r}}}\n"
        "print(json.dumps({'tokens': out.token_ids, 'error': out.error, 'specs': specs}))\n")
    env = {**os.environ, "PYTHONPATH": "."}
    done = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"] is None and len(result["tokens"]) == 4
    for name, origin in result["specs"].items():
        assert origin is None or Path(origin).parent != checkout / name, (name, origin)
    assert _imported(another_checkout) == ""


def test_server_started_in_another_checkout(tiny_chat_model, another_checkout):
    """`python -m radixlm.runtime.server` from a checkout's root: the server, its engine
    process and the grammar compile workers."""
    args = ["--model", str(tiny_chat_model), "--max-total-tokens", "4096",
            "--grammar-backend", "outlines"]
    with ServerProcess(args, startup_timeout=180, cwd=another_checkout) as server:
        out = _post(server.url + "/generate", {
            "text": "Yes or no?", "sampling_params": {
                "max_new_tokens": 4, "temperature": 0, "regex": "(yes|no)"}})
        assert out["text"] in ("yes", "no")
    assert _imported(another_checkout) == ""


def test_ray_replicas_started_in_another_checkout(tiny_chat_model, another_checkout):
    """--dp 2 from a checkout's root: Ray gives its workers the driver's working directory
    on sys.path."""
    pytest.importorskip("ray")
    args = ["--model", str(tiny_chat_model), "--max-total-tokens", "4096", "--dp", "2"]
    with ServerProcess(args, startup_timeout=180, cwd=another_checkout) as server:
        outs = _post(server.url + "/generate", {
            "input_ids": [[1, 5, 9], [1, 42]],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert [len(o["output_ids"]) for o in outs] == [4, 4]
    assert _imported(another_checkout) == ""
