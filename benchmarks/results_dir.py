"""Where a benchmark writes its JSON (and plots) unless `--out` says otherwise:
$RADIXLM_RESULTS_DIR, else ~/.cache/radixlm/benchmarks, never the repository's tree. To record
a run in the repository, pass `--out benchmarks/results/NAME.json` or set
RADIXLM_RESULTS_DIR=benchmarks/results.
"""

from __future__ import annotations

import os
from pathlib import Path


def results_dir() -> Path:
    folder = Path(os.environ.get("RADIXLM_RESULTS_DIR")
                  or Path.home() / ".cache" / "radixlm" / "benchmarks").expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    return folder
