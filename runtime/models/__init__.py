"""Models: the model families (one Llama-style implementation covers Llama, Mistral, Qwen2 and
Qwen3), their layers, loading (HF safetensors, GGUF, dummy weights) and quantized linears.

Imports attention, distributed (the collectives) and kernels; never scheduling, execution or
the engine.
"""
