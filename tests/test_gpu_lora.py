"""LoRA on CUDA (`pytest -m gpu`): the shrink/expand kernels at an 8B model's sizes in
bfloat16 against the plain-torch reference, and the engine with adapters in its decode graphs
against peft and against itself with the graphs off."""

from __future__ import annotations

import pytest
import torch
from test_engine import assert_no_leak
from test_lora import models, modules, peft_logprobs  # noqa: F401 (models is a fixture)
from test_lora_kernels import kernel_args, random_slots

from radixlm.runtime import Engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("in_features,parts", [(4096, [4096, 1024, 1024]), (14336, [4096])])
def test_kernels_bf16_at_8b_sizes(in_features, parts):
    from radixlm.kernels.lora import lora_add
    from radixlm.kernels.reference import lora_add_reference

    gen = torch.Generator().manual_seed(0)
    ranks, stride = [16, 64, 8, 64], 64
    a, b, cols = random_slots(ranks, stride, in_features, parts, gen, 1 / 64, 1 / 8)
    token_slots = torch.randint(-1, len(ranks), (77,), generator=gen).tolist()
    x = torch.randn(len(token_slots), in_features, generator=gen)
    out = torch.randn(len(token_slots), sum(parts), generator=gen)
    dev = dict(device="cuda", dtype=torch.bfloat16)
    x, out, a, b = x.to(**dev), out.to(**dev), a.to(**dev), b.to(**dev)
    got = lora_add(x, out.clone(), a, b, *kernel_args(token_slots, ranks, cols, "cuda"),
                   stride)
    want = lora_add_reference(x, out, a, b, token_slots)
    err = ((got.float() - want.float()).norm() / (want.float() - out.float()).norm()).item()
    assert err < 2e-2, err
    base = torch.tensor([s < 0 for s in token_slots], device="cuda")
    assert torch.equal(got[base], out[base])  # base-model rows are not touched


def test_engine_with_graphs_matches_peft_and_eager(models):  # noqa: F811
    """float32 (the kernels' ieee products): scores within 1e-3 of peft; a mixed batch's
    decode, replayed through the adapters' graphs, gives the tokens and (within 1e-4) the
    logprobs of the eager path."""
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    options = dict(device="cuda", dtype="float32", attention_backend="triton",
                   max_running_requests=8, lora_modules=modules(models, "a", "b", "c"))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 23, 9, 17, 14)]
    loras = ["a", "b", None, "a", "c"]
    params = {"temperature": 0, "max_new_tokens": 8, "min_new_tokens": 8, "logprobs": True}
    results = {}
    for graphs in (True, False):
        with Engine(str(models["base"]), disable_cuda_graph=not graphs, **options) as engine:
            if graphs:
                captured = engine.core.runner.cuda_graphs.graphs
                assert (1, True) in captured and (8, True) in captured
                for name in (None, "a", "b", "c"):
                    got = engine.score(ids[:12], [ids[12:]], lora=name)[0]
                    want = peft_logprobs(models, name, ids, 12)
                    assert max(abs(x - y) for x, y in zip(got, want)) < 1e-3, name
            outs = engine.generate(input_ids=prompts, sampling_params=params, lora=loras)
            results[graphs] = [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]
            assert_no_leak(engine)
    for (tokens, logprobs), (eager_tokens, eager_logprobs) in zip(results[True],
                                                                  results[False]):
        assert tokens == eager_tokens
        assert max(abs(x - y) for x, y in zip(logprobs, eager_logprobs)) < 1e-4


def test_deterministic_mode_mixed_batch_equals_each_row_alone(models):  # noqa: F811
    """deterministic=True in bfloat16: the kernels' sums do not depend on the other rows (a
    row's tile, input split and part order are fixed by the layer), so each row's tokens and
    logprobs are the same bits in a mixed batch, through the graphs, as alone."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 23, 9, 40, 14)]
    loras = ["a", "b", None, "a", "c"]
    params = {"temperature": 0, "max_new_tokens": 10, "min_new_tokens": 10, "logprobs": True}
    with Engine(str(models["base"]), device="cuda", dtype="bfloat16", deterministic=True,
                attention_backend="triton", lora_modules=modules(models, "a", "b", "c")) as eng:
        def tokens(outputs):
            return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outputs]

        alone = [tokens([eng.generate(input_ids=ids, sampling_params=params, lora=lora)])[0]
                 for ids, lora in zip(prompts, loras)]
        eng.flush_cache()
        mixed = tokens(eng.generate(input_ids=prompts, sampling_params=params, lora=loras))
        assert_no_leak(eng)
    assert mixed == alone
