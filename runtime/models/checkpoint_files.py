"""A checkpoint folder's safetensors files: their tensors (loaded, or lazily as slices each
rank reads its shard from) and their shapes from the files' headers alone, with one clear error
for a missing, truncated or corrupt file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, NoReturn

from radixlm.runtime.models.gguf_loader import TYPES_METADATA
from radixlm.runtime.models.quantization.gguf_blocks import GGUFBlocks


def checkpoint_files(folder: Path) -> list[str]:
    """The safetensors files of a checkpoint folder (its index's, else every one there)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def checkpoint_shapes(folder: Path) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """Every checkpoint tensor's shape, from the files' headers (no data is read), and the
    names of those stored as GGUF blocks ([rows, bytes per row])."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    packed: set[str] = set()
    for filename in checkpoint_files(folder):
        path = folder / filename
        try:
            with safe_open(str(path), framework="pt") as f:
                packed.update(json.loads((f.metadata() or {}).get(TYPES_METADATA, "{}")))
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except Exception as exc:
            _raise_unreadable(path, filename, folder, exc)
    return shapes, frozenset(packed)


def _raise_unreadable(path: Path, filename: str, folder: Path, exc: Exception) -> NoReturn:
    if isinstance(exc, FileNotFoundError):
        raise FileNotFoundError(f"the checkpoint names {filename}, which is not in "
                                f"{folder}") from None
    # safetensors' own errors: a truncated or corrupt file
    if isinstance(exc, (ValueError, RuntimeError, OSError)) or "Safetensor" in type(
            exc).__name__:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or "
                         f"corrupt?): {exc}") from None
    raise exc


def checkpoint_tensors(folder: Path, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every checkpoint tensor. `lazy`: a safetensors slice instead, from
    which each layer reads only its own shard (a rank never holds the whole model)."""
    from safetensors import safe_open

    for filename in checkpoint_files(folder):
        path = folder / filename
        try:
            with safe_open(str(path), framework="pt") as f:
                block_types = json.loads((f.metadata() or {}).get(TYPES_METADATA, "{}"))
                for key in f.keys():
                    if key in block_types:  # GGUF blocks: [rows, bytes per row] uint8
                        data = f.get_tensor(key)
                        yield key, GGUFBlocks.from_rows(block_types[key], data)
                    else:
                        yield key, f.get_slice(key) if lazy else f.get_tensor(key)
        except Exception as exc:
            _raise_unreadable(path, filename, folder, exc)
