"""The families beyond Llama (MoE, Gemma, Phi-3) and the Llama module's sliding windows
(Mistral, Phi-3, Qwen2/3), as tiny random configs in fp32: logits match transformers within
1e-4 whole and chunked, and greedy tokens match transformers' generate through the engine
(chunked prefill, decode, prefix-cache hits)."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.models.loader import load_model

from conftest import save_tiny_hf_model
from test_models import run_chunks, transformers_greedy

CPU = torch.device("cpu")
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
             "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
             "original_max_position_embeddings": 64}
# Each family with what makes it differ switched on: windows shorter than the 150-token
# prompt, soft-caps small enough to bite at random-weight scales, a dense layer among sparse
# ones, a query_pre_attn_scalar other than head_dim.
NEW_FAMILIES = {
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=40),
    "qwen2-moe": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                      num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False,
                      mlp_only_layers=[1], use_sliding_window=False),
    "qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                      norm_topk_prob=True, head_dim=32),
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16,
                   query_pre_attn_scalar=24, sliding_window=32, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
                   num_hidden_layers=3),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16,
                   query_pre_attn_scalar=24, sliding_window=32,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={
                       "full_attention": {"rope_type": "linear", "factor": 2.0,
                                          "rope_theta": 1000000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                   final_logit_softcapping=4.0, hidden_activation="gelu_pytorch_tanh",
                   num_hidden_layers=3),
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", pad_token_id=0,
                 original_max_position_embeddings=64, rope_scaling=_LONGROPE),
    # The Llama module's windows, shorter than the prompts and the 12 generated tokens: every
    # layer for Mistral and Phi-3, layers from max_window_layers up for Qwen.
    "mistral-window": dict(architectures=["MistralForCausalLM"], model_type="mistral",
                           sliding_window=8),
    "phi3-window": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", pad_token_id=0,
                        sliding_window=11),
    "qwen2-window": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                         use_sliding_window=True, sliding_window=9, max_window_layers=1,
                         num_hidden_layers=3),
    "qwen3-window": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32,
                         use_sliding_window=True, sliding_window=16, max_window_layers=2,
                         num_hidden_layers=3),
}


def save_family(folder, family: str, tie: bool = False, **overrides):
    return save_tiny_hf_model(folder, "llama", tie=tie, **{**NEW_FAMILIES[family], **overrides})


def reference_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits[0]


@pytest.mark.parametrize("family", sorted(NEW_FAMILIES))
def test_logits_match_transformers(tmp_path, family):
    folder = save_family(tmp_path, family, tie=family.startswith("gemma"))
    ids = torch.randint(3, 512, (1, 150), generator=torch.Generator().manual_seed(0))
    ref = reference_logits(folder, ids)
    loaded = load_model(str(folder), "auto", torch.float32, CPU)
    ours = run_chunks(loaded, ids[0].tolist(), [150])
    assert (ours - ref).abs().max().item() < 1e-4
    # Chunks and single decode steps on scattered pages give the same logits.
    chunked = run_chunks(loaded, ids[0].tolist(), [7, 1, 64, 1, 1, 76])
    assert (chunked - ref).abs().max().item() < 1e-4


def test_phi3_short_rope_within_the_pretraining_length(tmp_path):
    """A 40-token prompt on an engine serving at most 64 positions (the pretraining length)
    rotates with LongRoPE's short factors, as transformers does for short inputs."""
    folder = save_family(tmp_path, "phi3")
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    loaded = load_model(str(folder), "auto", torch.float32, CPU, max_positions=64)
    ours = run_chunks(loaded, ids[0].tolist(), [13, 1, 26])
    assert (ours - reference_logits(folder, ids)).abs().max().item() < 1e-4
    longer = load_model(str(folder), "auto", torch.float32, CPU)  # serves 1024: long factors
    assert (run_chunks(longer, ids[0].tolist(), [40]) - ours).abs().max().item() > 1e-3


@pytest.mark.parametrize("family", ["mixtral", "gemma2", "gemma3", "qwen2-moe",
                                    "mistral-window", "phi3-window", "qwen2-window"])
def test_greedy_matches_transformers_through_the_engine(tmp_path, family):
    """Prompts sharing a prefix (prefix-cache hits), prefilled in 16-token chunks mixed with
    decode steps, 12 tokens each: the tokens transformers' greedy generate gives."""
    from radixlm.runtime import Engine

    folder = save_family(tmp_path, family, tie=family.startswith("gemma"))
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 512, (70,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 30, 1)]
    prompts.append(shared[:45])
    expected = transformers_greedy(folder, prompts, 12)
    params = {"temperature": 0, "max_new_tokens": 12, "min_new_tokens": 12}
    with Engine(str(folder), device="cpu", dtype="float32", max_total_tokens=2048, page_size=4,
                chunked_prefill_size=16, max_num_batched_tokens=32) as engine:
        first = engine.generate(input_ids=prompts[0], sampling_params=params).token_ids
        rest = [o.token_ids for o in engine.generate(input_ids=prompts[1:],
                                                     sampling_params=params)]
        stats = engine.stats()
    assert [first] + rest == expected
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "gemma-3-12b",
                                  "phi-3-mini"])
def test_dummy_presets_match_transformers_parameter_counts(name):
    import transformers

    from radixlm.runtime.models.architecture.model_config import ModelConfig
    from radixlm.runtime.models.loader import model_class
    from radixlm.runtime.models.presets import ARCHITECTURE_PRESETS

    preset = ARCHITECTURE_PRESETS[name]
    config = ModelConfig.from_dict(preset)
    with torch.device("meta"):  # shapes only, no memory
        ours = model_class(config.architecture)(config, torch.bfloat16, max_positions=16)
        model_type = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
                      "Gemma3ForCausalLM": "gemma3_text", "Phi3ForCausalLM": "phi3"}[
            config.architecture]
        hf_config = transformers.AutoConfig.for_model(model_type, **preset)
        theirs = transformers.AutoModelForCausalLM.from_config(hf_config)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())


def test_dummy_moe_model_runs(tmp_path):
    folder = save_family(tmp_path, "qwen3-moe")
    loaded = load_model(str(folder), "dummy", torch.float32, CPU)
    out = run_chunks(loaded, list(range(3, 40)), [20, 17])
    assert out.shape == (37, 512) and torch.isfinite(out).all()


def test_window_counts_the_query_itself(tmp_path):
    """transformers' window of w: a query sees itself and the w - 1 keys before it (our
    LayerAttention, FlashInfer's window_left = w - 1). A window one shorter or longer than the
    config's gives other logits, so the matches above pin the count."""
    import dataclasses

    folder = save_family(tmp_path, "mistral-window")
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(4))
    ref = reference_logits(folder, ids)
    loaded = load_model(str(folder), "auto", torch.float32, CPU)
    assert loaded.config.layer_windows == (8, 8)
    assert (run_chunks(loaded, ids[0].tolist(), [40]) - ref).abs().max().item() < 1e-4
    for window in (7, 9):
        cfg = dataclasses.replace(loaded.config, layer_windows=(window, window))
        model = type(loaded.model)(cfg, torch.float32, max_positions=64)
        model.load_state_dict(loaded.model.state_dict())
        other = dataclasses.replace(loaded, model=model, config=cfg)
        assert (run_chunks(other, ids[0].tolist(), [40]) - ref).abs().max().item() > 1e-2


def test_applied_windows_no_longer_cap_the_context():
    """Mistral, Phi-3 and Qwen apply their windows, so a window shorter than the context
    leaves max_model_len at max_position_embeddings; a family that applies none (Llama) still
    stops at a configured window."""
    from radixlm.runtime.config.engine_config import EngineConfig
    from radixlm.runtime.engine.kv_sizing import max_model_len
    from radixlm.runtime.models.architecture.model_config import ModelConfig

    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=1024, sliding_window=8)
    for arch, extra in [("MistralForCausalLM", {}), ("Phi3ForCausalLM", {}),
                        ("Qwen2ForCausalLM", {"use_sliding_window": True}),
                        ("Qwen3ForCausalLM", {"use_sliding_window": True})]:
        mc = ModelConfig.from_dict({**base, **extra, "architectures": [arch]})
        assert mc.sliding_window == 8 and mc.layer_windows is not None
        assert max_model_len(EngineConfig(), mc, 1 << 20) == 1024
        assert max_model_len(EngineConfig(max_model_len=512), mc, 1 << 20) == 512
    llama = ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"]})
    assert llama.layer_windows is None
    assert max_model_len(EngineConfig(), llama, 1 << 20) == 8


def test_unknown_activation_is_refused():
    from radixlm.runtime.models.architecture.model_config import ModelConfig

    cfg = dict(architectures=["Gemma2ForCausalLM"], vocab_size=8, hidden_size=8,
               intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
               hidden_activation="relu")
    with pytest.raises(ValueError, match="relu.*gelu_pytorch_tanh"):
        ModelConfig.from_dict(cfg)


def test_moe_tp2_greedy_matches_tp1(tmp_path):
    """Qwen2-MoE (sparse layers, a dense layer, the shared expert) at TP=2 on gloo: each rank
    holds half of every expert, and greedy tokens equal TP=1 in fp32."""
    from radixlm.runtime import Engine

    folder = save_family(tmp_path, "qwen2-moe")
    prompts = [[1, 5, 9, 33, 7], [1] + list(range(100, 140))]
    params = {"max_new_tokens": 10, "temperature": 0}
    options = dict(dtype="float32", device="cpu", max_total_tokens=2048, tp_timeout=60)
    tokens = {}
    for tp in (1, 2):
        with Engine(str(folder), tp_size=tp, **options) as engine:
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            assert all(o.error is None for o in outs)
            tokens[tp] = [o.token_ids for o in outs]
            net = engine.core.runner.model
            net = net.model if tp > 1 else net  # rank 0's shard behind the sharded driver
            experts = net.model.layers[0].mlp.experts
            assert experts.intermediate_size == 32 // tp  # this rank's share of the channels
            # tiled for the CPU forward step (its eager copy released): this rank's rows
            assert experts.cpu_stacks["gate_up"].width == 2 * 32 // tp
    assert tokens[2] == tokens[1]
