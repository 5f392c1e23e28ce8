"""How long the OpenMP runtime's idle threads spin before they sleep: set when radixlm is
imported, before torch loads libgomp (which reads it once, as it loads).

The CPU step kernel (kernels/cpu_decode.cpp) runs a decode step as a few dozen parallel
regions of tens to hundreds of microseconds each, the calling thread doing Python work for a
few microseconds between steps. A worker thread that has gone to sleep between two regions
takes tens of microseconds to wake, which is the size of a region: left to its default, the
libgomp that torch ships lets its workers sleep almost at once (measured on a 2-core VM: a
1536 x 2048 Q4_K linear took 160 us on two threads, slower than on one; with a spin of
300,000 iterations, libgomp's documented default, 85 us; a Qwen3-30B-A3B-shaped decode 13.0
against 16.5 tokens/s). llama.cpp keeps its threads in its own spinning barriers instead.

300,000 iterations is a few milliseconds of spinning after the last region before a thread
sleeps, so an idle engine still goes idle. A value the user set is kept. Child processes
(the engine process, servers, workers) inherit it. Where torch was imported before radixlm,
libgomp has already read its settings and this comes too late for that process: import
radixlm first, or set GOMP_SPINCOUNT=300000 in the environment (docs/cpu.md).
"""

from __future__ import annotations

import os

SPIN_COUNT = "300000"
os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
