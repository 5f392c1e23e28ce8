"""`import radixlm` sets libgomp's spin count before torch loads it (lang/openmp_spin.py), and
keeps a value the user set."""

from __future__ import annotations

import os
import subprocess
import sys

# The variable's value at the moment torch is first imported (when libgomp reads it), and
# after the import.
PROBE = """
import os, sys
seen = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("GOMP_SPINCOUNT"))
sys.meta_path.insert(0, Watch())
import radixlm.runtime.models.quantization.cpu_weights
print(seen[0], os.environ.get("GOMP_SPINCOUNT"))
"""


def _probe(env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    return out.stdout.split()


def test_spin_count_is_set_before_torch_loads():
    from radixlm.openmp_spin import SPIN_COUNT

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert _probe(env) == [SPIN_COUNT, SPIN_COUNT]


def test_a_users_spin_count_is_kept():
    assert _probe({**os.environ, "GOMP_SPINCOUNT": "1234"}) == ["1234", "1234"]
