"""Execution: one scheduled batch through the model. The model runner (inputs, forward,
sampling, logprobs), the sampler as pure tensor functions, grammar masks for a batch, decode
CUDA graphs, and speculative decoding.

Imports scheduling (the batch it runs), models, attention, grammar, config and kernels.
"""
