"""`make demo`: a batch of chat prompts on the embedded SmolLM2-135M-Instruct, on CPU.

Prints each answer and a one-line throughput summary.
"""

from __future__ import annotations

import time

from radixlm.runtime import Engine, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "What is the difference between weather and climate?",
    "Suggest a name for a friendly robot.",
    "How many legs does a spider have?",
    "Why do we have leap years?",
]


def main() -> None:
    started = time.perf_counter()
    with Engine() as engine:
        loaded = time.perf_counter()
        conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
        # Greedy, with a mild repetition penalty: a 135M model otherwise loops on poems.
        params = SamplingParams(temperature=0, repetition_penalty=1.1, max_new_tokens=96)
        begin = time.perf_counter()
        outputs = engine.chat(conversations, params)
        elapsed = time.perf_counter() - begin
        for question, out in zip(QUESTIONS, outputs):
            print(f"\n### {question}\n{out.text.strip()}")
        generated = sum(o.completion_tokens for o in outputs)
        prompt = sum(o.prompt_tokens for o in outputs)
        print(f"\n{len(outputs)} requests, {prompt} prompt + {generated} generated tokens in "
              f"{elapsed:.2f} s: {generated / elapsed:.1f} generated tokens/s "
              f"(model loaded in {loaded - started:.1f} s, device {engine.device}, "
              f"dtype {str(engine.dtype).removeprefix('torch.')})")


if __name__ == "__main__":
    main()
