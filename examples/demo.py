"""`make demo`: the program examples, one after another, on the embedded SmolLM2-135M-Instruct
on CPU, sharing one engine. Ends with what the prefix cache saved.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import radixlm as rl

sys.path.insert(0, str(Path(__file__).resolve().parent))

import chat  # noqa: E402
import classify  # noqa: E402
import few_shot_qa  # noqa: E402
import json_extraction  # noqa: E402
import parallel_tips  # noqa: E402
import react_agent  # noqa: E402
import tool_agent  # noqa: E402

SHOWCASE = [
    ("Few-shot QA over a batch (run_batch)", few_shot_qa),
    ("Multi-turn chat with roles", chat),
    ("Parallel branches (fork / join)", parallel_tips),
    ("Classification with select", classify),
    ("JSON extraction (regex and JSON schema)", json_extraction),
    ("A tool-using agent (ReAct)", react_agent),
    ("An agent with OpenAI-style tool calls (tool_call)", tool_agent),
]


def main() -> None:
    started = time.perf_counter()
    with rl.Engine() as backend:
        print(f"model loaded in {time.perf_counter() - started:.1f} s "
              f"(device {backend.engine.device})")
        for title, example in SHOWCASE:
            print(f"\n### {title}  (examples/{Path(example.__file__).name})\n")
            begin = time.perf_counter()
            example.main(backend)
            print(f"\n[{time.perf_counter() - begin:.1f} s]")
        stats = backend.stats()
    prompt = stats["prefill_tokens_computed"] + stats["cached_tokens"]
    print(f"\n{stats['requests_finished']} requests, {stats['generated_tokens']} generated "
          f"tokens; {stats['cached_tokens']} of {prompt} prompt tokens came from the prefix "
          f"cache ({stats['cached_tokens'] / max(prompt, 1):.0%}); "
          f"total {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
