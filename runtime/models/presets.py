"""Architecture shapes without weights, for load_format="dummy": benchmarks and GPU tests
run real shapes with random weights (`radixlm models` lists them). Each is the config.json of
the public model, trimmed to what the architecture reads.
"""

from __future__ import annotations

from typing import Any

# Architecture shapes without weights, for load_format="dummy" (benchmarks, GPU tests).
ARCHITECTURE_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151643,
    },
    # A draft model for the 8B shape (same vocabulary): speculative-decoding benchmarks.
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "llama-3-70b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
    # Mixture-of-experts shapes (models/moe.py): Mixtral 8x7B (47B parameters, 13B active per
    # token) and Qwen3-30B-A3B (128 experts of 768 channels, 8 active).
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "use_sliding_window": False,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    # Gemma 3 12B's language model (models/gemma.py): 1024-token local windows, 5 per global.
    "gemma-3-12b": {
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262208, "hidden_size": 3840,
        "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 1024,
        "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "tie_word_embeddings": True, "bos_token_id": 2,
        "eos_token_id": [1, 106],
    },
    # Phi-3-mini-4k (models/phi3.py); every layer attends within a 2047-token window.
    "phi-3-mini": {
        "architectures": ["Phi3ForCausalLM"], "vocab_size": 32064, "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
        "sliding_window": 2047, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 32000,
    },
}
