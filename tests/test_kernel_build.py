"""Building the CPU decode kernel (kernels/cpu_decode.py through kernels/build_cache.py): a
build killed part-way (kill -9, an interrupt) leaves no lock that hangs the next run and no
compiler running, a half-written build is never used, a waiting run says whom it waits for,
and the cache is keyed by what changes the build, never by the checkout it was asked from."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from radixlm.kernels import build_cache
from radixlm.kernels import cpu_decode as kernel_build

COMPILERS = {"cc1plus", "c++", "g++", "gcc", "cc", "clang", "clang++", "ninja", "as", "ld"}


def _stat(pid: int) -> list[str] | None:
    """`/proc/<pid>/stat` after the command name: state, ppid, pgrp, session...; None when the
    process is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _with_cmdline(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                if _stat(int(entry)) is not None:
                    pids.append(int(entry))
        except OSError:
            pass
    return pids


def _wait_for(predicate, timeout: float, step: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(step)
    return predicate()


def _kill_tree(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# --- the real kernel ------------------------------------------------------------------------

LOAD = "from radixlm.kernels import cpu_decode; print('ok' if cpu_decode.load() else 'none')"


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None
                    or not Path("/proc").is_dir(), reason="needs a C++ compiler and /proc")
def test_a_build_killed_part_way_neither_hangs_the_next_nor_leaves_compilers(tmp_path):
    env = {**os.environ, "RADIXLM_CACHE_DIR": str(tmp_path), "RADIXLM_CPU_KERNEL": "1"}
    first = subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    second = None
    seen: set[int] = set()
    try:
        # Part-way: the compiler runs.
        compiling = _wait_for(lambda: [p for p in _descendants(first.pid)
                                       if _comm(p) == "cc1plus"], 90, 0.2)
        assert compiling, "the first build never started compiling"
        seen = {p for p in _descendants(first.pid) if _comm(p) in COMPILERS}
        first.kill()
        first.wait()
        second = subprocess.Popen([sys.executable, "-c", LOAD], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        left = _wait_for(lambda: not [p for p in seen if _stat(p)], 10) or \
            sorted(f"{p} {_comm(p)}" for p in seen if _stat(p))
        # The second run builds (a compiler of its own runs) or is done within 45 s; before
        # the fix it waited on the dead build's lock file forever at 0% CPU.
        started = _wait_for(lambda: second.poll() is not None or any(
            _comm(p) == "cc1plus" for p in _descendants(second.pid)), 45, 0.2)
        assert left is True and started, (
            f"compilers of the killed build still running: {left}; "
            f"the next build started: {bool(started)}")
        out, err = second.communicate(timeout=300)
        assert second.returncode == 0 and out.strip() == "ok", err[-2000:]
        # Seen by default (a warning), naming the folder.
        assert "building the CPU decode kernel (first use, ~1 min) in " in err, err
        folders = sorted((tmp_path / "kernels").iterdir())
        built = [f for f in folders if f.is_dir()]
        assert len(built) == 1 and built[0].name.startswith("cpu_decode-"), folders  # no .tmp
        # Compiled from its own copy of the source: no path of this checkout in the build.
        for file in built[0].iterdir():
            if file.suffix in ("", ".ninja", ".log", ".d") or file.name == "build.ninja":
                text = file.read_text(errors="replace")
                assert str(kernel_build.SOURCES[0]) not in text, file
                assert str(kernel_build.SOURCES[0].parent) + "/" not in text, file
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                _kill_tree(_descendants(proc.pid))
                proc.kill()
                proc.wait()
        _kill_tree(p for p in seen if _stat(p))


def test_build_key_follows_the_build_not_the_checkout(tmp_path):
    checkouts = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        checkouts.append([tmp_path / name / source.name for source in kernel_build.SOURCES])
        for source, copy in zip(kernel_build.SOURCES, checkouts[-1]):
            shutil.copyfile(source, copy)
    a, b = checkouts
    flags = ["-O3", "-march=native", "-fopenmp"]
    key = kernel_build.build_key(a, flags, ["/venv1/torch.libs/libgomp-ab12.so.1"], "c++")
    assert key == kernel_build.build_key(b, flags, ["/venv2/torch.libs/libgomp-ab12.so.1"],
                                         "c++")
    assert key != kernel_build.build_key(b, ["-O2", "-march=native", "-fopenmp"],
                                         ["/venv1/torch.libs/libgomp-ab12.so.1"], "c++")
    assert key != kernel_build.build_key(b, flags, [], "c++")
    for changed in b:  # either source
        original = changed.read_bytes()
        changed.write_bytes(original + b"\n// changed\n")
        assert key != kernel_build.build_key(b, flags, ["/venv1/torch.libs/libgomp-ab12.so.1"],
                                             "c++")
        changed.write_bytes(original)


# --- the lock and the rename, with a fake build ---------------------------------------------

HOLDER = textwrap.dedent("""
    import logging, signal, sys
    from pathlib import Path
    from radixlm.kernels import build_cache
    # Ctrl-C raises KeyboardInterrupt here, as in a terminal, even when the test run was
    # started in the background by a shell without job control (its children, this one
    # too, then inherit SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.basicConfig(level=logging.INFO)
    root, marker = Path(sys.argv[1]), sys.argv[2]

    def prepare(folder):
        (folder / "half").write_text("half-written")
        grandchild = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                      "'import time; time.sleep(300)', sys.argv[1] + '-grand'], process_group=0);"
                      " time.sleep(300)")
        return [sys.executable, "-c", grandchild, marker]

    build_cache.cached_build(root, "fake", "k1", prepare, "a fake build")
""")


def _start_holder(tmp_path: Path, marker: str) -> subprocess.Popen:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    holder = subprocess.Popen([sys.executable, str(script), str(tmp_path / "cache"), marker],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Part-way: the build and its compiler-like grandchild (a process group of its own, as
    # ninja gives each compiler) run.
    assert _wait_for(lambda: _with_cmdline(marker + "-grand"), 30), "the fake build never ran"
    return holder


def _quick(folder: Path) -> list[str]:
    return [sys.executable, "-c", "open('done', 'w').write('complete')"]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_a_killed_holder_frees_the_lock_and_its_half_build_is_never_used(tmp_path, caplog):
    marker = f"radixlm-test-{os.getpid()}-kill9"
    holder = _start_holder(tmp_path, marker)
    result: dict[str, object] = {}

    def build() -> None:
        try:
            result["folder"] = build_cache.cached_build(tmp_path / "cache", "fake", "k1",
                                                        _quick, "a fake build",
                                                        notice_after=0.5)
        except BaseException as exc:  # reported below
            result["error"] = exc

    caplog.set_level(logging.INFO, logger=build_cache.__name__)
    waiter = threading.Thread(target=build, daemon=True)
    try:
        waiter.start()
        # The waiter says what it waits for, and whom.
        assert _wait_for(lambda: any(f"pid {holder.pid}" in r.getMessage()
                                     for r in caplog.records), 10), caplog.text
        assert str(tmp_path / "cache" / "fake-k1") in caplog.text
        assert waiter.is_alive()
        holder.kill()
        holder.wait()
        waiter.join(15)
        assert not waiter.is_alive(), "the lock of a killed process still held the next build"
    finally:
        if holder.poll() is None:
            holder.kill()
        _kill_tree(_with_cmdline(marker))
    assert "error" not in result, result
    folder = tmp_path / "cache" / "fake-k1"
    assert result["folder"] == folder
    assert sorted(p.name for p in folder.iterdir()) == ["build.log", "done"]  # not "half"
    assert [p.name for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name] == []
    # The killed holder's build, compiler-like grandchild included, died with it.
    assert _wait_for(lambda: not _with_cmdline(marker), 10), _with_cmdline(marker)
    # Built: the next call neither locks nor builds.
    assert build_cache.cached_build(tmp_path / "cache", "fake", "k1", None, "x") == folder


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_an_interrupted_build_kills_its_processes_and_leaves_nothing(tmp_path):
    marker = f"radixlm-test-{os.getpid()}-sigint"
    holder = _start_holder(tmp_path, marker)
    try:
        holder.send_signal(signal.SIGINT)
        assert holder.wait(10) != 0
        assert _wait_for(lambda: not _with_cmdline(marker), 5), _with_cmdline(marker)
    finally:
        if holder.poll() is None:
            holder.kill()
        _kill_tree(_with_cmdline(marker))
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_a_failed_build_leaves_nothing_and_the_next_one_builds(tmp_path):
    def failing(folder: Path) -> list[str]:
        (folder / "half").write_text("half-written")
        return [sys.executable, "-c", "import sys; print('boom: no compiler'); sys.exit(3)"]

    with pytest.raises(build_cache.BuildError, match="boom: no compiler"):
        build_cache.cached_build(tmp_path, "fake", "k2", failing, "a fake build")
    assert [p.name for p in tmp_path.iterdir()] == ["fake-k2.lock"]
    assert (build_cache.cached_build(tmp_path, "fake", "k2", _quick, "a fake build")
            / "done").read_text() == "complete"
