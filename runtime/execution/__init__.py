"""Execution: one scheduled batch through the model. The model runner (inputs, forward, what
the step produced), decode CUDA graphs, the CPU decode path, the logits -> tokens step in
`sampling/` (pure tensor functions, grammar masks for a batch) and speculative decoding in
`speculative/`, which `sampling/` sits under.

Imports scheduling (the batch it runs), models, attention, config and kernels.
"""
