"""The adapters an engine serves: read at start (lora_modules) or while serving
(allow_runtime_lora_loading), kept on the host by name, and run through the model's slots.

A request names its adapter; `resolve` turns the name into the adapter object the request
keeps, so unloading or replacing a name never changes what a running request computes: the
adapter leaves host memory once no request holds it and its slot (if it has one) has been
given to another adapter. Loading and unloading happen on the caller's thread; the engine
thread only reads the adapters requests carry.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.models.lora.adapter import LoRAAdapter, load_adapter, targeted_linears
from radixlm.runtime.models.lora.slots import LoRASlots, slot_dtype

log = logging.getLogger(__name__)

# The slots' size when no adapter is given at start and max_lora_rank is not set.
DEFAULT_RUNTIME_RANK = 64
MAX_NAME_CHARS = 128


class LoRARegistry:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.model = model
        self._lock = threading.Lock()
        self.adapters: dict[str, LoRAAdapter] = {}
        for name, path in config.lora_paths().items():
            _check_name(name)
            self.adapters[name] = load_adapter(name, path, model)
        largest = max((a.rank for a in self.adapters.values()), default=DEFAULT_RUNTIME_RANK)
        self.max_rank = config.max_lora_rank or largest
        for adapter in self.adapters.values():
            self._check_rank(adapter)
        self.slots = LoRASlots(model, config.max_loras_per_batch, self.max_rank,
                               slot_dtype(device, dtype), device, self._targets())
        for adapter in self.adapters.values():
            self._check_targets(adapter)
        # Tensor parallelism names adapters by their index in this list, the same on every
        # rank (EngineCore.load_lora extends it).
        self.slots.catalog = [self.adapters[n] for n in sorted(self.adapters)]
        for adapter in self.adapters.values():
            log.info("LoRA adapter %r: rank %d, %d layers' modules, from %s", adapter.name,
                     adapter.rank, len(adapter.modules), adapter.path)

    def resolve(self, name: Any) -> LoRAAdapter:
        if not isinstance(name, str):
            raise ValueError(f"lora must be an adapter's name (a string), got "
                             f"{type(name).__name__}")
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise ValueError(f"lora: no adapter named {name!r} is loaded (loaded: {known})")
        return adapter

    def load(self, name: Any, path: Any) -> LoRAAdapter:
        """Read and add an adapter (allow_runtime_lora_loading); ValueError naming the field
        when it cannot be served."""
        self._check_runtime()
        _check_name(name)
        if not isinstance(path, str) or not path:
            raise ValueError("lora_path must be an adapter folder's path")
        with self._lock:
            if name in self.adapters:
                raise ValueError(f"lora_name: an adapter named {name!r} is already loaded; "
                                 "unload it first")
            if len(self.adapters) >= self.config.max_loaded_loras:
                raise ValueError(f"lora_name: {len(self.adapters)} adapters are loaded, the "
                                 f"most max_loaded_loras allows; unload one first")
            adapter = load_adapter(name, path, self.model)
            self._check_rank(adapter)
            self._check_targets(adapter)
            self.adapters[name] = adapter
        log.info("LoRA adapter %r loaded: rank %d, from %s", name, adapter.rank, path)
        return adapter

    def catalog_index(self, held: set[int]) -> int:
        """Where a new adapter goes in the slots' catalog (tensor parallelism): in place of
        an unloaded adapter that no request holds (`held`: ids of the adapters requests
        carry), else at the end; the catalog stays as long as the adapters in use."""
        live = {id(a) for a in self.adapters.values()}
        for index, old in enumerate(self.slots.catalog):
            if id(old) not in live and id(old) not in held:
                return index
        return len(self.slots.catalog)

    def unload(self, name: Any) -> None:
        self._check_runtime()
        with self._lock:
            if self.adapters.pop(name, None) is None:
                raise ValueError(f"lora_name: no adapter named {name!r} is loaded")
        log.info("LoRA adapter %r unloaded", name)

    def stats(self) -> dict[str, int]:
        return {"lora_adapters_loaded": len(self.adapters), "lora_slots": self.slots.num_slots,
                "lora_slot_loads": self.slots.loads}

    def listing(self) -> list[dict[str, Any]]:
        return [{"name": a.name, "path": a.path, "rank": a.rank}
                for a in self.adapters.values()]

    def _targets(self) -> set[str] | None:
        """The linears that hold slots: those lora_target_modules names, else those the
        adapters given at start train (an adapter of q and v costs nothing in the other
        layers), else, with runtime loading, every decoder linear (None)."""
        if self.config.lora_target_modules is not None:
            return targeted_linears(self.model, self.config.lora_target_modules)
        if self.config.allow_runtime_lora_loading:
            return None
        return {module for a in self.adapters.values() for module in a.modules}

    def _check_targets(self, adapter: LoRAAdapter) -> None:
        outside = sorted({m.rpartition(".")[2] for m in adapter.modules
                          if m not in self.slots.linears})
        if outside:
            raise ValueError(
                f"lora_target_modules: adapter {adapter.name!r} trains layers this engine "
                f"holds no adapter slots for ({', '.join(outside)}); start it with "
                f"--lora-target-modules naming them, or all")

    def _check_rank(self, adapter: LoRAAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise ValueError(f"lora {adapter.name!r}: rank {adapter.rank} is larger than "
                             f"max_lora_rank ({self.max_rank})")

    def _check_runtime(self) -> None:
        if not self.config.allow_runtime_lora_loading:
            raise PermissionError("loading and unloading adapters while serving is off; start "
                                  "with allow_runtime_lora_loading (--allow-runtime-lora-"
                                  "loading)")


def _check_name(name: Any) -> None:
    if (not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS
            or any(c.isspace() for c in name)):
        raise ValueError(f"lora_name must be 1 to {MAX_NAME_CHARS} characters without spaces, "
                         f"got {name!r:.60}")
