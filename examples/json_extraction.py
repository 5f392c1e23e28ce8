"""Structured extraction: a JSON schema and a regex constrain what the model may write, so
the output always parses; no retries, no repair.

    python examples/json_extraction.py
"""

from __future__ import annotations

import argparse
import json

import radixlm as rl

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
}

TEXTS = ["Maria Lopez is a 34-year-old architect who lives in Madrid.",
         "Kenji, 27, moved to Osaka last spring to work as a chef."]


@rl.function
def extract(s, text):
    s += rl.user(f"Extract the person's name, age and city as JSON.\nText: {text}")
    s += rl.assistant(rl.gen("person", json_schema=PERSON))
    s += rl.user("On what date was this written? Answer as YYYY-MM-DD.")
    s += rl.assistant(rl.gen("date", regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"))


def main(backend: rl.Backend, max_tokens: int = 96) -> list[dict]:
    states = extract.run_batch([{"text": t} for t in TEXTS], backend=backend, temperature=0,
                               max_tokens=max_tokens, progress_bar=False)
    people = []
    for text, state in zip(TEXTS, states):
        person = json.loads(state["person"])
        people.append(person)
        print(f"{text}\n  -> {json.dumps(person)}   date: {state['date']}")
    return people


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    with rl.Engine() as engine:
        main(engine, parser.parse_args().max_tokens)
