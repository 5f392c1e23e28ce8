"""Classification with `select`: the model scores every label in one engine call over the
shared prompt, and the most likely one is picked; no parsing of free text.

    python examples/classify.py
"""

from __future__ import annotations

import argparse

import radixlm as rl

LABELS = ["Positive", "Negative"]


@rl.function
def sentiment(s, review):
    s += rl.user(f"Review: {review}\nIs this review positive or negative? Answer with one word.")
    # Scored against each label's likelihood without the review: a small model's bias
    # towards one label cancels out.
    s += rl.assistant(rl.select("label", choices=LABELS,
                                choices_method=rl.unconditional_likelihood_normalized))


def main(backend: rl.Backend, max_tokens: int = 0) -> list[str]:
    reviews = ["An absolute delight from start to finish, I loved it.",
               "Boring, far too long, and the ending made no sense.",
               "The best meal I have had in years; the staff were wonderful.",
               "It broke after two days and support never answered."]
    states = sentiment.run_batch([{"review": r} for r in reviews], backend=backend,
                                 progress_bar=False)
    labels = [state["label"] for state in states]
    for review, state in zip(reviews, states):
        scores = state.get_meta_info("label")["scores"]
        detail = ", ".join(f"{c} {x:.2f}" for c, x in zip(LABELS, scores))
        print(f"{state['label']:>8}  ({detail})  {review}")
    return labels


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=0, help="unused: select generates "
                        "nothing")
    with rl.Engine() as engine:
        main(engine, parser.parse_args().max_tokens)
