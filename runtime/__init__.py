"""The radixlm runtime: the offline `Engine`, its sampling parameters and outputs.

Names are resolved lazily so that importing a light module (e.g. `sampling_params`) does not
load the model stack.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "EngineClosedError", "EngineConfig", "Output", "SamplingParams"]

_EXPORTS = {
    "Engine": "radixlm.runtime.engine.engine",
    "EngineClosedError": "radixlm.runtime.engine.engine_thread",
    "EngineConfig": "radixlm.runtime.config.engine_config",
    "Output": "radixlm.runtime.scheduling.request",
    "SamplingParams": "radixlm.runtime.config.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'radixlm.runtime' has no attribute {name!r}")
