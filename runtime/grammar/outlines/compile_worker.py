"""A grammar compile worker: a child process that turns a grammar (a regex, or a JSON schema
expanded into one here) into an outlines-core index.

Run as a module (`python -m radixlm.runtime.grammar.outlines.compile_worker <memory limit in
bytes>`; as a script, its own folder would go first on sys.path and its siblings would be
importable as top-level modules). It imports nothing from the engine but the grammar package's
pure-Python schema code. Compiling runs in its own process so that one that takes too long or
too much memory can be killed (or dies alone) without touching the engine.

Protocol over stdin/stdout, frames of a 4-byte little-endian length and a pickle:
    parent -> ("vocab", eos_id, {bytes: [token ids]})      once, first
    parent -> ("compile", kind, source, max_spaces)        then any number of times
    child  -> ("ok", index_pickle, seconds, regex) | ("error", message)
"""

from __future__ import annotations

import os
import pickle
import resource
import struct
import sys
import time


def read_frame(stream) -> object | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack("<I", head)
    return pickle.loads(stream.read(size))


def write_frame(stream, message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def main() -> None:
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # Frames go to the original stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    try:
        os.nice(5)  # the engine's decode loop comes first on a busy machine
    except OSError:
        pass
    from outlines_core import Index, Vocabulary

    from radixlm.runtime.grammar.outlines.json_schema import spec_regex
    from radixlm.runtime.grammar.spec import GrammarSpec

    vocabulary = None
    while True:
        message = read_frame(inp)
        if message is None:
            return
        kind = message[0]
        if kind == "vocab":
            vocabulary = Vocabulary(message[1], message[2])
            write_frame(out, ("ready",))
        elif kind == "compile":
            start = time.perf_counter()
            try:
                regex = spec_regex(GrammarSpec(message[1], message[2]), message[3])
                # outlines-core builds its automaton with leftmost-first semantics: in
                # `(yes|yesterday)` the first branch wins once it matches, so the second could
                # never be generated. Anchored at the end, every branch stays a full match.
                index = Index(f"(?:{regex})$", vocabulary)
                reply = ("ok", pickle.dumps(index), time.perf_counter() - start, regex)
            except MemoryError:
                reply = ("error", "out of memory while compiling")
            except RecursionError:
                reply = ("error", "the grammar nests too deeply")
            except BaseException as exc:  # ours raise ValueError, outlines also a Rust panic
                text = str(exc).strip().splitlines()
                reply = ("error", text[0] if text else type(exc).__name__)
            write_frame(out, reply)


if __name__ == "__main__":
    main()
