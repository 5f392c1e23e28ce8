"""Parallel branches: expand each tip in its own branch, join, and summarise.

`s.fork(n)` branches share everything before the fork; radixlm computes that prefix once and
pins it in the cache until the branches join, so every branch hits it.

    python examples/parallel_tips.py
"""

from __future__ import annotations

import argparse

import radixlm as rl

TIPS = ["Take a short break every hour.", "Put your phone in another room.",
        "Start with the hardest task."]


@rl.function
def tips(s, topic, tips):
    s += rl.user(f"Here are some tips for {topic}:\n" + "\n".join(
        f"{i + 1}. {tip}" for i, tip in enumerate(tips)))
    s += rl.assistant("Thanks, these look useful.")
    forks = s.fork(len(tips))
    for i, branch in enumerate(forks):
        branch += rl.user(f"Explain why tip {i + 1} ({tips[i]}) helps, in two sentences.")
        branch += rl.assistant(rl.gen("detail"))
    details = s.join(forks)["detail"]
    s += rl.user("Now summarise all the tips in one sentence.")
    s += rl.assistant(rl.gen("summary", stop="\n"))
    return details


def main(backend: rl.Backend, max_tokens: int = 64) -> dict[str, object]:
    state = tips.run(topic="staying focused while studying", tips=TIPS, backend=backend,
                     temperature=0, max_tokens=max_tokens)
    for tip, detail in zip(TIPS, state["detail"]):
        print(f"* {tip}\n  {detail.strip()}\n")
    print("Summary: " + state["summary"].strip())
    return {"detail": state["detail"], "summary": state["summary"]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    with rl.Engine() as engine:
        main(engine, parser.parse_args().max_tokens)
