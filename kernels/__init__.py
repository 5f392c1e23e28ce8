"""Kernels: Triton attention (triton_attention: K/V store, split-KV paged decode, paged extend),
fused elementwise Triton kernels (fused), and the plain-torch references they are tested
against (reference). Importing the Triton modules needs the triton package; reference does not.
"""
