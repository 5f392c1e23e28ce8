"""Few-shot question answering over a batch, with `run_batch` and a progress bar.

The few-shot examples are the same for every question: radixlm finds that shared prefix by
tracing the program, computes it once and keeps it cached while the batch runs.

    python examples/few_shot_qa.py
"""

from __future__ import annotations

import argparse

import radixlm as rl

SHOTS = [("Germany", "Berlin"), ("Spain", "Madrid"), ("Canada", "Ottawa"), ("Kenya", "Nairobi")]


@rl.function
def capital(s, country):
    for example, city in SHOTS:
        s += f"Q: What is the capital of {example}?\nA: {city}\n\n"
    s += f"Q: What is the capital of {country}?\nA:" + rl.gen("city", stop="\n")


def main(backend: rl.Backend, max_tokens: int = 8) -> list[str]:
    countries = ["France", "Japan", "Italy", "Egypt", "Greece", "Russia", "China", "Peru"]
    states = capital.run_batch([{"country": c} for c in countries], backend=backend,
                               temperature=0, max_tokens=max_tokens, progress_bar=True)
    answers = [state["city"].strip() for state in states]
    for country, city in zip(countries, answers):
        print(f"{country:>8}: {city}")
    return answers


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=8)
    with rl.Engine() as engine:
        main(engine, parser.parse_args().max_tokens)
