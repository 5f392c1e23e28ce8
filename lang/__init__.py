"""radixlm: structured LLM programs and the runtime that executes them.

`import radixlm as rl`. The program language lands here; the runtime is `radixlm.runtime`.
"""

from __future__ import annotations

__version__ = "0.1.0"
