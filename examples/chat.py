"""A multi-turn chat with roles, rendered through the model's own chat template.

    python examples/chat.py
"""

from __future__ import annotations

import argparse

import radixlm as rl


@rl.function
def conversation(s, turns):
    s += rl.system("You are a friendly, concise assistant.")
    for i, question in enumerate(turns):
        s += rl.user(question)
        s += rl.assistant(rl.gen(f"answer_{i}", stop="\n\n"))


def main(backend: rl.Backend, max_tokens: int = 64) -> list[dict[str, str]]:
    turns = ["What is the largest planet in the solar system?",
             "How many moons does it have, roughly?",
             "Summarise our conversation in one sentence."]
    state = conversation.run(turns=turns, backend=backend, temperature=0,
                             max_tokens=max_tokens)
    for message in state.messages():
        print(f"[{message['role']}] {message['content'].strip()}")
    return state.messages()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    with rl.Engine() as engine:
        main(engine, parser.parse_args().max_tokens)
