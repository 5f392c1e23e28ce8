"""stop_regex: the cost per generated token of watching for a pattern, ours against the
baseline SGLang uses (Python's `re.search` over a tail window of the output, every step).

Ours feeds each new piece of text to a llguidance regex matcher over bytes (linear in the
text). The baseline re-decodes nothing here (it is given the text) and searches the last
`window` characters with `re` each step. Each case streams a real token sequence of the
default model's tokenizer through both; the catastrophic case is a pattern on which Python's
backtracking needs exponential time in the window, the reason we do not use `re` on the
engine thread. The physical floor is the tokenizer's own cost per token, measured beside.

    python benchmarks/stop_regex.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import time
from pathlib import Path

from transformers import AutoTokenizer

from radixlm.runtime.engine.detokenizer import IncrementalDetokenizer
from radixlm.runtime.grammar.stop_regex import StopRegexMatcher
from radixlm.runtime.models.loader import resolve_model

from results_dir import results_dir

TEXT = ("The quick brown fox jumps over the lazy dog, and then the dog sleeps in the sun "
        "while the fox counts to one hundred and twenty three before it runs away. ") * 40
CASES = [
    ("literal word", r"runs away\. The end", TEXT),
    ("digits then a period", r"Answer: \d+\.", TEXT),
    ("alternation", r"(?:zebra|giraffe|elephant) [a-z]+", TEXT),
    # (a+)+b on a run of a's: Python's re takes ~2^window steps per search.
    ("catastrophic (a+)+b", r"(a+)+b", "a" * 2000),
]
WINDOW = 24  # characters the baseline searches each step (a short pattern's bound)


def per_token_us(fn, pieces: list[str]) -> float:
    start = time.perf_counter()
    fn(pieces)
    return (time.perf_counter() - start) / len(pieces) * 1e6


def ours(pattern: str):
    def run(pieces: list[str]) -> None:
        matcher = StopRegexMatcher([pattern])
        for piece in pieces:
            if matcher.feed(piece):
                return
    return run


def baseline(pattern: str, deadline_s: float):
    compiled = re.compile(pattern)

    def run(pieces: list[str]) -> None:
        text = ""
        stop_at = time.perf_counter() + deadline_s
        for piece in pieces:
            text += piece
            if compiled.search(text[-WINDOW:]):
                return
            if time.perf_counter() > stop_at:
                raise TimeoutError
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file (default: a dated file in "
                        "$RADIXLM_RESULTS_DIR or ~/.cache/radixlm/benchmarks)")
    parser.add_argument("--baseline-deadline", type=float, default=20.0,
                        help="seconds after which a baseline run counts as stalled")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    rows = []
    for name, pattern, text in CASES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = [tokenizer.decode([t]) for t in ids]
        detok = IncrementalDetokenizer(tokenizer, [])
        floor = per_token_us(lambda p: [detok.push(t) for t in ids], pieces)
        our_us = per_token_us(ours(pattern), pieces)
        try:
            base_us: float | None = per_token_us(baseline(pattern, args.baseline_deadline),
                                                 pieces)
        except TimeoutError:
            base_us = None
        rows.append({"case": name, "pattern": pattern, "tokens": len(ids),
                     "ours_us_per_token": our_us, "python_re_us_per_token": base_us,
                     "detokenize_us_per_token": floor})
    print(f"{'case':<24}{'tokens':>8}{'ours µs/tok':>14}{'re µs/tok':>14}{'detok µs/tok':>15}")
    for r in rows:
        base = ("stalled" if r["python_re_us_per_token"] is None
                else f"{r['python_re_us_per_token']:.2f}")
        print(f"{r['case']:<24}{r['tokens']:>8}{r['ours_us_per_token']:>14.2f}{base:>14}"
              f"{r['detokenize_us_per_token']:>15.2f}")
    today = datetime.date.today().isoformat()
    out = Path(args.out or results_dir() / f"stop_regex_cpu_{today}.json")
    out.write_text(json.dumps({"date": today, "machine": platform.processor() or
                               platform.machine(), "window_chars": WINDOW,
                               "baseline_deadline_s": args.baseline_deadline, "rows": rows},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
