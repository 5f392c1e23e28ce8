"""Mixture-of-experts execution: routing, the grouped torch path against a per-token loop,
the block alignment, and the fused Triton kernel against the grouped path (fp32 under the
Triton interpreter here; bf16 on the GPU, also inside a CUDA graph)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.runtime.models.layers.moe import FusedMoE, grouped_moe, route_top_k

from interpreter_cases import collect_cases, main, results_under_interpreter


def random_moe(tokens: int, experts: int, top_k: int, hidden: int = 64, inter: int = 48,
               dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
               skew: bool = False):
    """x, w13, w2 and a routing; `skew` sends most tokens to a few experts (and leaves
    some experts unused)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    logits = torch.randn(tokens, experts, generator=gen)
    if skew:
        logits[:, :3] += 4.0
    weights, ids = route_top_k(logits, top_k, renormalize=True)
    to = dict(device=device)
    return (x.to(dtype=dtype, **to), w13.to(dtype=dtype, **to), w2.to(dtype=dtype, **to),
            weights.to(**to), ids.to(**to))


def per_token_reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """The definition, one token and one expert at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = ids[t, slot].item()
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += weights[t, slot].double() * (w2[e].double() @ (F.silu(gate) * up))
    return out


def test_route_top_k():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.0]])
    weights, ids = route_top_k(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids[0].tolist() == [1, 2] and torch.allclose(weights[0], probs[0, [1, 2]])
    weights, ids = route_top_k(logits, 2, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(2))
    assert sorted(ids[1].tolist()) == [0, 3]


@pytest.mark.parametrize("tokens,experts,top_k,skew", [(1, 8, 2, False), (37, 8, 2, True),
                                                       (50, 64, 6, False), (5, 16, 16, False)])
def test_grouped_matches_per_token(tokens, experts, top_k, skew):
    x, w13, w2, weights, ids = random_moe(tokens, experts, top_k, skew=skew)
    out = grouped_moe(x, w13, w2, weights, ids)
    assert (out.double() - per_token_reference(x, w13, w2, weights, ids)).abs().max() < 1e-5


def test_fused_moe_layer_loads_experts_and_shards():
    """Checkpoint pieces land at the right rows; a rank of two holds the right halves, and
    the two ranks' partial outputs sum to the whole."""
    from radixlm.runtime.distributed.groups import TPInfo

    x, w13, w2, weights, ids = random_moe(9, 4, 2)
    whole = FusedMoE(4, 64, 48, torch.float32)
    halves = [FusedMoE(4, 64, 48, torch.float32, TPInfo(rank, 2)) for rank in (0, 1)]
    for layer in [whole] + halves:
        for e in range(4):
            gate, up = w13[e].chunk(2)
            layer.weight_loader(layer.w13, gate, (e, "gate"))
            layer.weight_loader(layer.w13, up, (e, "up"))
            layer.weight_loader(layer.w2, w2[e], (e, "down"))
        assert len(layer.checkpoint_shards("w13")) == 8
    assert torch.equal(whole.w13, w13) and torch.equal(whole.w2, w2)
    assert torch.equal(halves[1].w13[2, :24], w13[2, 24:48])  # rank 1's gate rows
    full = grouped_moe(x, whole.w13, whole.w2, weights, ids)
    parts = sum(grouped_moe(x, h.w13, h.w2, weights, ids) for h in halves)
    assert (full - parts).abs().max() < 1e-5


def test_align_to_blocks():
    from radixlm.kernels.fused_moe import align_to_blocks

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    pairs, block_expert = align_to_blocks(ids, num_experts=4, block_m=4)
    pad = 6
    assert block_expert.tolist()[:3] == [0, 1, 2] and set(block_expert.tolist()[3:]) == {-1}
    assert pairs.tolist()[:12] == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    assert set(pairs.tolist()[12:]) <= {pad}


# -- the fused kernel under the Triton interpreter (this file run as a script) ------------

def _fused_case(tokens: int, experts: int, top_k: int, skew: bool = False) -> str:
    from radixlm.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = random_moe(tokens, experts, top_k, skew=skew)
    out = fused_moe(x, w13, w2, weights, ids)
    err = (out - grouped_moe(x, w13, w2, weights, ids)).abs().max().item()
    assert err < 1e-5, f"max error {err:.2e}"
    return f"max err {err:.1e}"


def case_fused_decode_top2():
    return _fused_case(1, 8, 2)


def case_fused_prefill_skewed():
    return _fused_case(45, 8, 2, skew=True)


def case_fused_many_experts():
    return _fused_case(70, 32, 4)  # P = 280 pairs: 64-row blocks


_CASES = collect_cases(globals())


@pytest.fixture(scope="module")
def interpreter_results():
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", _CASES)
def test_fused_moe_under_interpreter(interpreter_results, case):
    result = interpreter_results[case]
    assert result["ok"], result["detail"]


# -- GPU: bf16 kernel against the torch grouped reference, eager and in a graph -----------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (1, 8, 2, 1024, 1792), (64, 8, 2, 1024, 1792), (300, 8, 2, 512, 896),
    (1, 128, 8, 512, 192), (200, 128, 8, 512, 192)])
def test_gpu_fused_moe_matches_grouped(tokens, experts, top_k, hidden, inter):
    from radixlm.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = random_moe(tokens, experts, top_k, hidden, inter,
                                          torch.bfloat16, "cuda", skew=tokens > 100)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = grouped_moe(x, w13, w2, weights, ids)
    scale = ref.float().abs().max().item()
    assert (out.float() - ref.float()).abs().max().item() < 2e-2 * scale


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_moe_in_a_cuda_graph():
    """Captured once, replayed with new routings: the same as eager each time."""
    from radixlm.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = random_moe(4, 16, 4, 256, 128, torch.bfloat16, "cuda")
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed in (1, 2, 3):
        new = random_moe(4, 16, 4, 256, 128, torch.bfloat16, "cuda", seed=seed)
        x.copy_(new[0])
        weights.copy_(new[3])
        ids.copy_(new[4])
        graph.replay()
        assert torch.equal(out, fused_moe(x, w13, w2, weights, ids))


if __name__ == "__main__":
    main(globals())
