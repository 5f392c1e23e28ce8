"""An Engine's life end to end, each scenario in a fresh interpreter: leaving the interpreter
with an engine still open (a request running, a stream left early, two engines) exits cleanly
rather than aborting ("terminate called without an active exception"), and close() from any
thread fails the calls waiting on the engine instead of leaving them blocked."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

TIMEOUT_S = 120  # a fresh interpreter imports torch and loads the tiny model in a few seconds

PRELUDE = """
import asyncio, sys, threading, time
from radixlm.runtime.engine.engine import Engine

def engine():
    return Engine(sys.argv[1], max_total_tokens=4096, page_size=16)

LONG = {"max_new_tokens": 900, "ignore_eos": True, "temperature": 0}
"""


def run_script(body: str, model: object) -> subprocess.CompletedProcess:
    script = PRELUDE + textwrap.dedent(body)
    try:
        return subprocess.run([sys.executable, "-c", script, str(model)], capture_output=True,
                              text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the script hung for {TIMEOUT_S} s; stderr: {exc.stderr!r:.2000}")


def assert_clean_exit(done: subprocess.CompletedProcess) -> None:
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("done"), done.stdout


@pytest.mark.parametrize("scenario", [
    # A request still running at exit.
    """
    e = engine()
    e.submit_stream(lambda out: None, "hello", LONG)
    time.sleep(0.5)
    """,
    # A stream left early with break (the async generator is closed by asyncio.run).
    """
    e = engine()
    async def main():
        async for out in e.generate_stream("hello", {"max_new_tokens": 500,
                                                      "ignore_eos": True}):
            break
    asyncio.run(main())
    """,
    # generate inside asyncio.run.
    """
    e = engine()
    async def main():
        return e.generate("hello", {"max_new_tokens": 4})
    asyncio.run(main())
    """,
    # Two engines, both busy at exit.
    """
    a, b = engine(), engine()
    for e in (a, b):
        e.submit_stream(lambda out: None, "hello", LONG)
    time.sleep(0.5)
    """,
], ids=["running-request", "stream-left-early", "generate-in-asyncio-run", "two-engines"])
def test_exit_with_an_open_engine_is_clean(tiny_chat_model, scenario):
    assert_clean_exit(run_script(textwrap.dedent(scenario) + "print('done')\n",
                                 tiny_chat_model))


def test_close_from_another_thread_fails_a_waiting_generate(tiny_chat_model):
    done = run_script("""
    e = engine()
    closed_at = []
    def close_soon():
        time.sleep(1.0)
        closed_at.append(time.monotonic())
        e.close()
    threading.Thread(target=close_soon).start()
    try:
        e.generate(["hello"] * 32, LONG)
    except RuntimeError as exc:
        waited = time.monotonic() - closed_at[0]
        print("raised:", exc, f"{waited:.1f}s after close")
        assert waited < 10, waited
    else:
        raise AssertionError("generate returned from a closed engine")
    for call in (lambda: e.generate("hello"), lambda: e.score([1, 2], [[3]]),
                 lambda: e.pin_prefix("hello " * 20), lambda: e.flush_cache()):
        try:
            call()
        except RuntimeError as exc:
            assert "closed" in str(exc), exc
        else:
            raise AssertionError("a call on a closed engine did not raise")
    print("done")
    """, tiny_chat_model)
    assert_clean_exit(done)
    assert "raised: " in done.stdout and "closed" in done.stdout


def test_close_from_another_thread_fails_a_waiting_stream(tiny_chat_model):
    done = run_script("""
    e = engine()
    async def main():
        got = 0
        try:
            async for out in e.generate_stream("hello", LONG):
                got += 1
                if got == 1:  # mid-stream, however fast the model decodes
                    threading.Thread(target=e.close).start()
        except RuntimeError as exc:
            print("raised:", exc, "after", got, "chunks")
        else:
            raise AssertionError("the stream ended normally on a closed engine")
    asyncio.run(asyncio.wait_for(main(), 30))
    print("done")
    """, tiny_chat_model)
    assert_clean_exit(done)
    assert "raised: " in done.stdout and "closed" in done.stdout


def test_an_unclosed_program_backend_exits_cleanly(tiny_chat_model):
    done = run_script("""
    import radixlm as rl
    backend = rl.Engine(sys.argv[1], max_total_tokens=4096, page_size=16)
    backend.engine.submit_stream(lambda out: None, "hello", LONG)
    time.sleep(0.5)
    print("done")
    """, tiny_chat_model)
    assert_clean_exit(done)
