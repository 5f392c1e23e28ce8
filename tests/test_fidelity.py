"""The real default model (SmolLM2-135M-Instruct from its GGUF file) against transformers'
own GGUF load of the same file: logits, and greedy tokens under batching, staggered arrival
and chunked prefill."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from radixlm.runtime import Engine
from radixlm.runtime.models.loader import embedded_model_file

NEW_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a name for a pet turtle.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "Write a Python function that reverses a string.",
]


@pytest.fixture(scope="module")
def hf():
    import transformers

    try:
        path = embedded_model_file()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module")
def prompts(hf):
    from pydoc_data.topics import topics

    tok, _ = hf
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    long_text = "\n".join(topics[k] for k in sorted(topics))[:4400]  # ~900 tokens
    chats.append([{"role": "user", "content": "Summarize this:\n" + long_text}])
    chats.append([{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Hi"}])
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
             for c in chats]
    texts.append("The history of the Roman Empire")  # a plain completion prompt
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    assert max(len(i) for i in ids) > 800 and min(len(i) for i in ids) < 20
    return ids


@pytest.fixture(scope="module")
def hf_greedy(hf, prompts):
    _, model = hf
    outs = []
    with torch.no_grad():
        for ids in prompts:  # one at a time: no padding anywhere in the reference
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False)
            outs.append(gen[0, len(ids):].tolist())
    return outs


def test_gguf_logits_match_transformers(hf, prompts):
    _, model = hf
    ids = prompts[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    with Engine(max_total_tokens=4096, dtype="float32") as engine:
        out = engine.generate(input_ids=ids, sampling_params={
            "max_new_tokens": 1, "logprob_start_len": 0, "top_logprobs_num": 5})
    ref_logprobs = torch.log_softmax(ref, dim=-1)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry.logprob - ref_logprobs[pos - 1, ids[pos]].item()) < 1e-4
        assert [t for t, _ in entry.top] == ref_logprobs[pos - 1].topk(5).indices.tolist()
    # Logits themselves, straight from our model on the same file.
    from radixlm.runtime.models.loader import load_model

    from test_models import run_chunks

    loaded = load_model(None, "auto", torch.float32, torch.device("cpu"))
    ours = run_chunks(loaded, ids, [len(ids)])
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("chunk", [16, 1024])
def test_greedy_matches_transformers(prompts, hf_greedy, chunk):
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}
    results: dict[int, list[int]] = {}
    with Engine(chunked_prefill_size=chunk, max_num_batched_tokens=max(chunk, 256), dtype="float32",
                max_total_tokens=16384) as engine:
        def submit(i: int) -> None:
            time.sleep(0.05 * (i % 4))  # staggered arrival: later requests join running ones
            results[i] = engine.generate(input_ids=prompts[i], sampling_params=params).token_ids

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        stats = engine.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    mismatches = [i for i in range(len(prompts)) if results.get(i) != hf_greedy[i]]
    assert not mismatches, f"prompts {mismatches} differ from transformers"
