"""Attention and other kernels: plain-torch references now; Triton and FlashInfer later."""
