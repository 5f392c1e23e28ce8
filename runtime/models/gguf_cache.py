"""The on-disk cache of converted GGUF files: one folder per file content, written atomically.

A folder is named after the GGUF file's stem and a key of its content (not its path or mtime:
a copy or a touched file hits the same folder, a changed one does not), and records what it was
converted from in `radixlm_source.json`. A conversion writes into a dot-prefixed sibling that
is renamed into place when complete, so a folder either does not exist or is whole, even if the
process is killed half-way, and two processes converting the same file at once both end with
the same folder. `radixlm cache` lists and clears it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

SOURCE_FILE = "radixlm_source.json"  # in each cache folder: what it was converted from
_SAMPLE_BYTES = 1 << 16
_SAMPLES = 32


def cache_root(root: str | os.PathLike | None = None) -> pathlib.Path:
    """Where converted GGUF files are kept: `root`, $RADIXLM_CACHE_DIR or ~/.cache/radixlm."""
    if root is None:
        root = os.environ.get("RADIXLM_CACHE_DIR") or pathlib.Path.home() / ".cache/radixlm"
    return pathlib.Path(root).expanduser() / "gguf"


def content_key(path: pathlib.Path, version: int) -> str:
    """A key for the file's content and the converter's `version`: its size and a hash of its
    header, its end and 32 slices spread over it. Reads about 2 MiB whatever the file's size."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}|{version}".encode())
    with open(path, "rb") as f:
        offsets = {0, max(0, size - _SAMPLE_BYTES)}
        offsets.update(size * i // _SAMPLES for i in range(1, _SAMPLES))
        for offset in sorted(offsets):
            f.seek(offset)
            digest.update(f.read(_SAMPLE_BYTES if offset else 1 << 20))
    return digest.hexdigest()[:16]


def converted_folder(gguf_path: str | os.PathLike,
                     convert: Callable[[pathlib.Path, pathlib.Path], None], version: int,
                     root: str | os.PathLike | None = None) -> pathlib.Path:
    """The cache folder of this GGUF file, made by `convert(gguf_file, folder)` on first use."""
    path = pathlib.Path(gguf_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    path = path.resolve()
    final = cache_root(root) / f"{path.stem}-{content_key(path, version)}"
    if final.is_dir():
        return final

    final.parent.mkdir(parents=True, exist_ok=True)
    # A sibling on the same filesystem: os.replace is then atomic.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    # Said by default (a warning): the first run is otherwise silent for this long.
    logger.warning("converting %s (%.0f MB) into a Hugging Face folder in %s (first use "
                   "only)", path.name, path.stat().st_size / 1e6, final)
    start = time.perf_counter()
    try:
        convert(path, tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({
            "source": str(path), "size": path.stat().st_size, "converted": time.time(),
            "converter_version": version}) + "\n")
        _make_readable(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process finished the same conversion first; its folder is equally good.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Converted GGUF %s to %s in %.1f s", path, final, time.perf_counter() - start)
    return final


def cache_entries(root: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """The converted models in the cache: folder, bytes on disk, source file, when."""
    entries = []
    folder = cache_root(root)
    for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        record: dict[str, Any] = {}
        try:
            record = json.loads((entry / SOURCE_FILE).read_text())
        except (OSError, ValueError):
            pass  # converted by an older version: no record
        entries.append({"folder": entry, "bytes": sum(f.stat().st_size for f in entry.iterdir()
                                                      if f.is_file()),
                        "source": record.get("source"), "converted": record.get("converted")})
    return entries


def clear_cache(root: str | os.PathLike | None = None) -> int:
    """Delete every converted model (and unfinished conversions); the bytes freed."""
    freed = 0
    folder = cache_root(root)
    for entry in list(folder.iterdir()) if folder.is_dir() else []:
        if entry.is_dir():
            freed += sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
            shutil.rmtree(entry, ignore_errors=True)
    return freed


def _make_readable(folder: pathlib.Path) -> None:
    # mkdtemp (and safetensors) create private 0700/0600 entries; a cache should get the
    # permissions that ordinarily created files get under the current umask.
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for child in folder.iterdir():
        child.chmod(0o666 & ~umask)
